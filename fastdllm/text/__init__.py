"""Text in and out, without torch: the tokenizer and chat templates, stop handling, tool calls."""
