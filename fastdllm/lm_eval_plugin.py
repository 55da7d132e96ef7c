"""lm-evaluation-harness model `fastdllm`: generation tasks through our decoding engine.

Install the extra (`pip install 'fastdllm[lm-eval]'`), then either

    # the command line: this module registers the model, then runs lm_eval's own CLI
    python -m fastdllm.lm_eval_plugin --model fastdllm \\
        --model_args pretrained=GSAI-ML/LLaDA-8B-Instruct,threshold=0.9,cache=dual,gen_length=256 \\
        --tasks gsm8k --num_fewshot 5 --batch_size 8

    # or Python: importing this module registers the model
    import lm_eval, fastdllm.lm_eval_plugin
    lm_eval.simple_evaluate(model="fastdllm", model_args="threshold=0.9,cache=dual", tasks=["gsm8k"])

Why the wrapper: lm_eval finds model classes in its registry, which only its own modules fill
(there is no plugin entry point for models), so the class must be registered in the process
before lm_eval's CLI parses `--model`; `python -m fastdllm.lm_eval_plugin` does exactly that and
takes the same arguments as `lm_eval`, and adds this package's task folder (`TASKS_DIR`) as
`--include_path` unless one is given: `--tasks fastdllm_arith` then runs the embedded models' own
test split offline (in Python: `lm_eval.tasks.TaskManager(include_path=TASKS_DIR)`).

model_args: `pretrained` (folder or hub id; default the embedded model), `device`, `dtype`,
`preset` (a file that `fastdllm tune` wrote; the fields given beside it override it), `lora` (a
PEFT adapter folder, merged into the weights: as vLLM's `lora_local_path`), and any
GenerationConfig field (gen_length, block_length, steps, threshold, factor, cache, alg,
temperature, ...), e.g. `threshold=none` for the schedule. Without gen_length, each request's
`max_gen_toks` is used (rounded up to a whole number of blocks). Each request's `until` strings
cut the answer (`fastdllm.text.completion.complete`); `--batch_size N` decodes N prompts together.

`loglikelihood` (multiple choice) and `loglikelihood_rolling` (perplexity) use the Monte-Carlo
ELBO of `fastdllm.engine.likelihood`, as LLaDA's and Dream's reference wrappers do: model_args `mc_num`
(samples per request, default 128), `mc_batch_size` (samples per forward, default 16, dividing
mc_num) and `mc_seed` (default 0). It is a lower bound on the log-likelihood, not the exact value.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .config import PRESETS, GenerationConfig

MODEL_NAME = "fastdllm"
# Task configs that ship with fastdllm (`fastdllm_arith`: the embedded models' test split, no
# download); lm-eval reads one --include_path, so a user's own replaces this one.
TASKS_DIR = Path(__file__).parent / "evaluation" / "lm_eval_tasks"
_REGISTERED: dict[str, Any] = {}


def _config_kwargs(kwargs: dict) -> dict:
    """GenerationConfig fields among model_args, parsed by each field's kind ("none" for None)."""
    names = set(GenerationConfig.field_names())
    return {k: GenerationConfig.parse(k, v) for k, v in kwargs.items() if k in names}


class LMMethods:
    """The lm_eval model's behaviour, on no base class: `make_model_class` puts lm_eval's `LM`
    under it, so that it can be tested without lm_eval."""

    def __init__(
        self,
        pretrained: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
        mc_num: int | str = 128,
        mc_batch_size: int | str = 16,
        mc_seed: int | str = 0,
        preset: str | None = None,
        lora: str | None = None,
        **kwargs,
    ):
        super().__init__()
        from .models.loading import load

        self.mc_num, self.mc_batch_size, self.mc_seed = int(mc_num), int(mc_batch_size), int(mc_seed)
        if self.mc_num < 1 or self.mc_batch_size < 1 or self.mc_num % self.mc_batch_size:
            raise ValueError(
                f"mc_num: must be a positive multiple of mc_batch_size (got {self.mc_num} and {self.mc_batch_size})"
            )
        unknown = [k for k in kwargs if k not in GenerationConfig.field_names()]
        if unknown:
            raise ValueError(
                f"fastdllm: unknown model_args {', '.join(sorted(unknown))}; use pretrained, "
                f"device, dtype, preset, lora or GenerationConfig fields ({', '.join(GenerationConfig.field_names())})"
            )
        self.gen_kwargs = _config_kwargs(kwargs)
        self.fixed_gen_length = "gen_length" in self.gen_kwargs
        self.base_config = GenerationConfig(**self.gen_kwargs)  # validates the values now
        if device is not None and str(device).startswith("cuda"):
            import torch

            if not torch.cuda.is_available():  # lm_eval's CLI passes --device cuda by default
                device = None
        # a PEFT adapter merged into the weights: every request type (generation, likelihoods) uses it
        self.model, self.tokenizer = load(pretrained, dtype=dtype, device=device, adapters=[lora] if lora else None)
        if preset in PRESETS:  # a named preset, fitted to the model, the model_args given on top
            self.base_config = GenerationConfig.preset(preset, **self.gen_kwargs).fit_to_model(
                self.model, keep=set(self.gen_kwargs), own_block=preset == "default"
            )
            self.fixed_gen_length = True
        elif preset is not None:  # a tuned preset, with the model_args given beside it on top
            family = getattr(getattr(self.model, "family", None), "name", None)
            self.base_config = GenerationConfig.from_preset(preset, family=family, **self.gen_kwargs)
            self.fixed_gen_length = True
        else:  # as the CLI: the model's own decoding where it has one, what its family needs, model_args on top
            self.base_config = GenerationConfig.for_model(self.model, **self.gen_kwargs)
        self.pretrained = pretrained or "fastdllm/llada-arith"
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1
        self._device = self.model.device
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        except ImportError:
            pass

    # -- the request types ------------------------------------------------------------
    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # As lm-eval's own models: encode the whole, so the boundary tokenises as in running text.
        whole = self.tokenizer.encode(context + continuation, add_special_tokens=False)
        prefix = self.tokenizer.encode(context, add_special_tokens=False)
        if whole[: len(prefix)] != prefix:
            return prefix, self.tokenizer.encode(continuation, add_special_tokens=False)
        return prefix, whole[len(prefix) :]

    def loglikelihood(self, requests):
        from .engine.likelihood import is_greedy, loglikelihood

        out = []
        for req in requests:
            prefix, target = self._split(*req.args[:2])
            if not prefix:
                prefix = [self.model.args.eos_token_id]
            ll = loglikelihood(self.model, prefix, target, self.mc_num, self.mc_batch_size, self.mc_seed)
            out.append((ll, is_greedy(self.model, prefix, target)))
        return out

    def loglikelihood_rolling(self, requests):
        from .engine.likelihood import loglikelihood

        eos = self.model.args.eos_token_id
        return [
            loglikelihood(
                self.model,
                [eos],
                self.tokenizer.encode(req.args[0], add_special_tokens=False),
                self.mc_num,
                self.mc_batch_size,
                self.mc_seed,
            )
            for req in requests
        ]

    def _config_for(self, gen_kwargs: dict) -> GenerationConfig:
        changes: dict[str, Any] = {}
        if gen_kwargs.get("do_sample") and "temperature" not in self.gen_kwargs:
            changes["temperature"] = float(gen_kwargs.get("temperature", 1.0) or 0.0)
        if not self.fixed_gen_length and gen_kwargs.get("max_gen_toks"):
            return self.base_config.with_max_new_tokens(int(gen_kwargs["max_gen_toks"]), **changes)
        return self.base_config.replace(**changes) if changes else self.base_config

    def generate_until(self, requests, disable_tqdm: bool = False):
        from .engine.generation import generate
        from .text.completion import complete
        from .text.infill import encode_infill

        stop_ids = list(getattr(self.model, "stop_token_ids", None) or self.tokenizer.stop_token_ids())
        results: list[str | None] = [None] * len(requests)
        # Group requests with the same settings; decode `batch_size` at a time.
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            gen_kwargs = (req.args[1] if len(req.args) > 1 else {}) or {}
            config = self._config_for(gen_kwargs)
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            key = (tuple(sorted(config.to_dict().items())), tuple(until))
            groups.setdefault(key, []).append(i)
        bar = None
        if not disable_tqdm and self.rank == 0:
            try:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(requests), desc="fastdllm generate_until")
            except ImportError:
                bar = None
        for key, idxs in groups.items():
            config = encode_infill(GenerationConfig(**dict(key[0])), self.tokenizer, self.model.mask_token_id)
            until = list(key[1])
            for start in range(0, len(idxs), self.batch_size):
                chunk = idxs[start : start + self.batch_size]
                prompts = [self.tokenizer.encode(requests[i].args[0], add_special_tokens=False) for i in chunk]
                out = generate(self.model, prompts, config=config, row_seeds=[(config.seed or 0) + i for i in chunk])
                for row, i in enumerate(chunk):
                    text = complete(self.tokenizer, out.sequences[row], stop_ids, until, config.fixed_end).text
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                if bar is not None:
                    bar.update(len(chunk))
        if bar is not None:
            bar.close()
        return results

    # -- chat templates -----------------------------------------------------------------
    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        return self.tokenizer.render_chat(chat_history, add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return str(self.pretrained).replace("/", "__")

    def chat_template(self, chat_template=False):
        return self.tokenizer.chat_template or ""

    # -- ranks (torchrun / accelerate launch with torch.distributed initialised) ----------
    def all_gather(self, tensor):
        if self.world_size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts)

    def gather_object(self, obj, dst=0):
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        parts = [None] * self.world_size
        dist.all_gather_object(parts, obj)
        return parts if self.rank == dst else None

    def barrier(self):
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


def make_model_class(LM, register=None):
    """The lm_eval model class: `LMMethods` on lm_eval's `LM` base (registered when given
    `register_model`)."""
    cls = type("FastDLLM", (LMMethods, LM), {"__module__": __name__})
    if register is not None:
        register(MODEL_NAME)(cls)
    return cls


def register() -> Any:
    """Register the `fastdllm` model with lm_eval (idempotent); returns the class."""
    if "cls" in _REGISTERED:
        return _REGISTERED["cls"]
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError as e:
        raise ImportError("fastdllm.lm_eval_plugin needs lm-evaluation-harness: pip install 'fastdllm[lm-eval]'") from e
    _REGISTERED["cls"] = make_model_class(LM, register_model)
    return _REGISTERED["cls"]


try:  # importing the module registers the model when lm_eval is installed
    FastDLLM = register()
except ImportError:
    FastDLLM = None


def main(argv: list[str] | None = None) -> int:
    """`python -m fastdllm.lm_eval_plugin <lm_eval arguments>`: register, then run lm_eval's CLI."""
    try:
        register()
    except ImportError as e:
        print(f"fastdllm.lm_eval_plugin: {e}", file=sys.stderr)
        return 2
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in sys.argv[1:]):
        sys.argv += ["--include_path", str(TASKS_DIR)]
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        print(f"fastdllm.lm_eval_plugin: cannot find lm_eval's CLI ({e})", file=sys.stderr)
        return 2
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
