"""lm-evaluation-harness task configs that ship with fastdllm (`fastdllm_arith`); the folder is
given to lm-eval as an --include_path by `python -m fastdllm.lm_eval_plugin`."""
