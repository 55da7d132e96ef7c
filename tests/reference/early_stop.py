"""What the d3LLM runners count of a run: the forwards that reveal nothing. With its early stop,
d3LLM fills everything after a revealed EOS with EOS but decodes that forward with the masks it
read before filling, so its forced token can land on a filled position."""


def open_masks(x, prompt_length: int, mask_id: int, eos_id: int) -> int:
    """The masks of the answer in `x` (1, L) before its first EOS (all of them without one)."""
    region = x[0, prompt_length:]
    eos = (region == eos_id).nonzero()
    end = int(eos[0, 0]) if len(eos) else len(region)
    return int((region[:end] == mask_id).sum())


def idle_forwards(seen: list[int], final: int) -> int:
    """The forwards after which the open masks were as many as before them: `seen` per forward
    (before it), `final` after the last."""
    return sum(a == b for a, b in zip(seen, seen[1:] + [final]))
