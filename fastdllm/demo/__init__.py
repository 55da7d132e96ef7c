"""The web demo (`fastdllm demo`, the `demo` extra): `frames` reads the engine's steps into what
a pane shows; `app` is the Gradio page."""
