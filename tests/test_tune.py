"""`fastdllm tune`: the paired statistics on cases with known answers, the race on synthetic
settings, the space taken from GenerationConfig's declarations, presets wherever a config goes,
and the command end to end."""

from __future__ import annotations

import json
import random

import pytest

from fastdllm.config import PRESET_FORMAT, ConfigError, GenerationConfig
from fastdllm.tuning.search import Candidate, Race, candidates, search_space
from fastdllm.tuning.stats import drop_interval, lower_bound, problems_needed, upper_bound


# ---- statistics ---------------------------------------------------------------------------------
def test_exact_bounds_have_their_closed_forms():
    for n in (1, 7, 100, 500):
        for alpha in (0.05, 0.1):
            assert upper_bound(0, n, alpha) == pytest.approx(1 - alpha ** (1 / n), rel=1e-9)
            assert lower_bound(n, n, alpha) == pytest.approx(alpha ** (1 / n), rel=1e-9)
    # one success in ten at alpha 0.05: the p at which P(X <= 1) = 0.05 is 0.3942 (tabled)
    assert upper_bound(1, 10, 0.05) == pytest.approx(0.3942, abs=1e-4)
    assert lower_bound(9, 10, 0.05) == pytest.approx(1 - 0.3942, abs=1e-4)
    assert problems_needed(0.01, 0.9) == 299 and upper_bound(0, 299, 0.05) <= 0.01 < upper_bound(0, 298, 0.05)


def test_the_interval_counts_regressions_and_gains_on_the_same_problems():
    ref = [True] * 80 + [False] * 20
    setting = [True] * 70 + [False] * 10 + [True] * 5 + [False] * 15  # 10 regressions, 5 gains
    iv = drop_interval(ref, setting, 0.9)
    assert (iv.regressions, iv.gains, iv.drop) == (10, 5, 0.05)
    assert iv.lower < 0.05 < iv.upper
    same = drop_interval(ref, ref, 0.9)
    assert same.drop == 0 and same.upper == pytest.approx(1 - 0.05 ** (1 / 100)) and same.lower == -same.upper
    with pytest.raises(ValueError, match="same problems"):
        drop_interval(ref, setting[:-1])
    with pytest.raises(ValueError, match="confidence"):
        drop_interval(ref, setting, 1.0)


def _simulate(r: float, g: float, n: int, budget: float, trials: int, seed: int) -> float:
    """The share of trials in which a setting with regression rate r and gain rate g is certified."""
    rng, certified = random.Random(seed), 0
    for _ in range(trials):
        ref, setting = [], []
        for _ in range(n):
            u = rng.random()
            ref.append(u >= g)  # a gain: the reference wrong, the setting right
            setting.append(u < g or u >= g + r)
        certified += drop_interval(ref, setting, 0.9).within(budget)
    return certified / trials


@pytest.mark.slow
def test_a_setting_over_budget_is_certified_at_most_at_the_stated_rate():
    # True drop 2.5 points against a budget of 2: at 90 % confidence, certified in at most ~10 %.
    assert _simulate(0.03, 0.005, 400, 0.02, 300, 1) <= 0.10 + 0.04
    # Exactly at the budget the bound is the most stretched; still at most the stated share.
    assert _simulate(0.02, 0.0, 400, 0.02, 300, 2) <= 0.10 + 0.04


@pytest.mark.slow
def test_a_setting_well_within_budget_is_certified_most_of_the_time():
    assert _simulate(0.002, 0.002, 1000, 0.02, 100, 3) >= 0.9


# ---- the race -----------------------------------------------------------------------------------
class FakeEvaluator:
    """Settings named by threshold: each is right on a known set of problems and costs a known
    number of positions per token."""

    def __init__(self, wrong: dict[float | None, set[int]], cost: dict[float | None, int], nfe=None):
        self.wrong, self.cost, self.calls = wrong, cost, []
        self.nfe = nfe or cost  # forwards per problem (10 tokens each)

    def __call__(self, config, indices):
        self.calls.append((config.threshold, list(indices)))
        t = config.threshold
        records = [
            {
                "index": i,
                "correct": i not in self.wrong[t],
                "forward_positions": self.cost[t] * 10,
                "num_tokens": 10,
                "nfe": self.nfe[t],
            }
            for i in indices
        ]
        return records, 0.01 * len(indices)


def test_the_race_drops_settings_over_budget_early_and_picks_the_fastest_certified():
    n = 400
    wrong = {None: set(), 0.5: set(range(0, n, 8)), 0.7: {3}, 0.9: set()}  # 0.5 loses 12.5 points
    cost = {None: 100, 0.5: 2, 0.7: 4, 0.9: 8}
    fake = FakeEvaluator(wrong, cost)
    pool = [Candidate(f"t{t}", GenerationConfig(threshold=t)) for t in (0.5, 0.7, 0.9)]
    race = Race(fake, GenerationConfig.baseline(), pool, list(range(n)), budget=0.02, confidence=0.9)
    result = race.run()
    assert result.chosen.label == "t0.7" and result.chosen.status == "chosen"
    by = {c.label: c for c in pool}
    assert by["t0.5"].status.startswith("over budget") and len(by["t0.5"].records) == race.rungs[0]
    assert by["t0.9"].status.startswith("cut at") or by["t0.9"].status == "racing"
    assert result.indices == list(range(n)) and by["t0.7"].interval.within(0.02)


def test_the_aup_metric_weighs_accuracy_against_tokens_per_forward():
    """0.7 costs the fewest positions but loses 2 points; 0.9 loses nothing with a few more forwards:
    work per token picks 0.7, AUP (d3LLM's) picks 0.9."""
    n = 400
    wrong = {None: set(), 0.7: set(range(0, n, 50)), 0.9: set()}
    cost = {None: 100, 0.7: 4, 0.9: 5}
    nfe = {None: 100, 0.7: 4, 0.9: 4.1}
    chosen = {}
    for metric in ("positions_per_token", "aup"):
        pool = [Candidate(f"t{t}", GenerationConfig(threshold=t)) for t in (0.7, 0.9)]
        race = Race(
            FakeEvaluator(wrong, cost, nfe), GenerationConfig.baseline(), pool, list(range(n)), 0.05, metric=metric
        )
        chosen[metric] = race.run().chosen.label
    assert chosen == {"positions_per_token": "t0.7", "aup": "t0.9"}
    by = {c.label: c for c in pool}
    idx = list(range(n))
    assert by["t0.9"].aup(race.reference, idx, 100.0) == pytest.approx(0.1 * 100 + 0.5 * (10 / 4.1 - 0.1) * 200)


def test_a_setting_certified_early_that_fails_later_leaves_its_backup():
    """0.5 is fast and clean on the first half of the split, then wrong on the second; 0.7 is
    clean throughout: certified at rung 2 beside it, it must still be there at the last rung."""
    n = 800
    wrong = {None: set(), 0.5: set(range(400, 800, 5)), 0.7: set(), 0.9: set()}
    cost = {None: 100, 0.5: 2, 0.7: 4, 0.9: 8}
    fake = FakeEvaluator(wrong, cost)
    pool = [Candidate(f"t{t}", GenerationConfig(threshold=t)) for t in (0.5, 0.7, 0.9)]
    result = Race(fake, GenerationConfig.baseline(), pool, list(range(n)), budget=0.02, min_keep=1).run()
    by = {c.label: c for c in pool}
    assert by["t0.5"].status.startswith("over budget at 800") and result.chosen.label == "t0.7"


def test_with_nothing_certified_the_reference_is_chosen():
    fake = FakeEvaluator({None: set(), 0.5: set(range(0, 40, 2))}, {None: 100, 0.5: 2})
    pool = [Candidate("t0.5", GenerationConfig(threshold=0.5))]
    result = Race(fake, GenerationConfig.baseline(), pool, list(range(40)), budget=0.01).run()
    assert result.chosen is result.reference and result.chosen.status == "chosen"


def test_the_default_stays_unless_a_faster_setting_is_certified():
    """A tuner never hands back something slower than the default it measured: with nothing faster
    certified (here only the slow reference-like 0.99 is), the default is kept and the report says so."""
    n = 400
    wrong = {None: set(), 0.5: set(range(0, n, 4)), 0.9: set(range(0, n, 40)), 0.99: set()}
    cost = {None: 100, 0.5: 2, 0.9: 8, 0.99: 50}
    fake = FakeEvaluator(wrong, cost)
    pool = [Candidate("default", GenerationConfig(threshold=0.9))]
    pool += [Candidate(f"t{t}", GenerationConfig(threshold=t)) for t in (0.5, 0.99)]
    result = Race(fake, GenerationConfig.baseline(), pool, list(range(n)), budget=0.02, confidence=0.9).run()
    assert result.kept_default and result.chosen.label == "default" and result.chosen.status == "chosen"
    by = {c.label: c for c in pool}
    assert by["t0.99"].interval.within(0.02) and not by["default"].interval.within(0.02)


def test_a_spent_time_budget_stops_the_race_and_says_so():
    fake = FakeEvaluator({None: set(), 0.9: set()}, {None: 100, 0.9: 8})
    pool = [Candidate("t0.9", GenerationConfig(threshold=0.9))]
    result = Race(fake, GenerationConfig.baseline(), pool, list(range(40)), budget=0.5, time_budget=0.0).run()
    assert result.stopped_early and result.chosen is result.reference
    assert pool[0].status == "not decoded (time budget)" and [c[0] for c in fake.calls] == [None]


def test_the_race_refuses_bad_parameters():
    fake = FakeEvaluator({None: set()}, {None: 1})
    with pytest.raises(ValueError, match="metric"):
        Race(fake, GenerationConfig(), [], [0], 0.01, metric="speed")
    with pytest.raises(ValueError, match="budget"):
        Race(fake, GenerationConfig(), [], [0], 1.5)
    with pytest.raises(ValueError, match="calibration"):
        Race(fake, GenerationConfig(), [], [], 0.01)


# ---- the space ----------------------------------------------------------------------------------
def test_the_space_is_generation_configs_declarations(tiny_llada):
    declared = GenerationConfig.search_space()
    assert set(search_space(tiny_llada)) == set(declared) - {"editing_threshold"}
    base = GenerationConfig(gen_length=64, block_length=16)
    pool = candidates(tiny_llada, base, {}, random_count=0)
    for name, values in search_space(tiny_llada).items():
        seen = {getattr(c.config, name) for c in pool}
        # a block that does not divide gen_length is left out; the rest is tried
        assert {v for v in values if name != "block_length" or 64 % v == 0} <= seen, name
    keys = [tuple(sorted(c.config.to_dict().items())) for c in pool]
    assert len(keys) == len(set(keys)) and pool[0].label == "default"
    only = candidates(tiny_llada, base, {}, random_count=3, fields=["threshold"])
    assert {c.config.threshold for c in only} >= set(declared["threshold"])
    assert all(c.config.cache == base.cache and c.config.block_length == 16 for c in only)
    with pytest.raises(ValueError, match="search: seed declare"):
        search_space(tiny_llada, ["seed"])


def test_a_block_causal_family_searches_only_what_changes_its_decoding(tiny_sdar, tiny_v2, tiny_llada2):
    assert "cache" not in search_space(tiny_sdar) and "block_length" in search_space(tiny_sdar)
    assert "block_length" not in search_space(tiny_v2)  # its block must be the training block
    assert "editing_threshold" in search_space(tiny_llada2)
    base = GenerationConfig.for_model(tiny_v2, GenerationConfig(gen_length=64), checkpoint_defaults=False)
    assert {c.config.block_length for c in candidates(tiny_v2, base, {}, random_count=4)} == {base.block_length}


# ---- presets ------------------------------------------------------------------------------------
def _preset(path, family="LLaDA", **config):
    path.write_text(json.dumps({"format": PRESET_FORMAT, "family": family, "config": config}))
    return path


def test_a_preset_file_loads_as_a_config_and_refuses_another_family(tmp_path):
    p = _preset(tmp_path / "p.json", threshold=0.7, gen_length=64, block_length=16)
    cfg = GenerationConfig.from_preset(p, family="LLaDA", seed=3)
    assert (cfg.threshold, cfg.gen_length, cfg.seed) == (0.7, 64, 3)
    with pytest.raises(ConfigError, match="tuned for LLaDA models, not SDAR"):
        GenerationConfig.from_preset(p, family="SDAR")
    (tmp_path / "bad.json").write_text(json.dumps({"format": PRESET_FORMAT, "config": {"speed": 1}}))
    with pytest.raises(ConfigError, match="unknown fields speed") as e:
        GenerationConfig.from_preset(tmp_path / "bad.json")
    assert e.value.param == "preset"
    with pytest.raises(ConfigError, match="no preset file"):
        GenerationConfig.from_preset(tmp_path / "missing.json")


def test_every_command_takes_a_preset_file(tmp_path, capsys):
    from fastdllm.cli.main import main as cli

    p = _preset(tmp_path / "fast.json", threshold=0.5, gen_length=32, block_length=16, stop_at_eos=False)
    assert cli(["generate", "--preset", str(p), "--json", "Tom has 5 apples. He buys 3 more apples."]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["threshold"] == 0.5
    other = _preset(tmp_path / "sdar.json", family="SDAR", threshold=0.5)
    assert cli(["generate", "--preset", str(other), "hi"]) == 2
    assert "tuned for SDAR models, not LLaDA" in capsys.readouterr().err
    assert cli(["eval", "--task", "arith", "--preset", "no-such", "--limit", "1"]) == 2
    assert "--preset: one of default, fast-dllm, baseline" in capsys.readouterr().err


def test_a_request_names_a_preset(tmp_path):
    from fastapi.testclient import TestClient

    import fastdllm
    from fastdllm.server import ServerSettings, create_app

    model, tok = fastdllm.load(dtype="float32")
    tuned = GenerationConfig.from_preset(_preset(tmp_path / "t.json", threshold=0.5, block_length=16))
    settings = ServerSettings("m", GenerationConfig(gen_length=32), presets={"t": tuned})
    with TestClient(create_app(model, tok, settings)) as client:
        body = {"model": "m", "prompt": "1 + 1 =", "max_tokens": 16, "stop_at_eos": False}
        ok = [client.post("/v1/completions", json={**body, "preset": name}) for name in ("baseline", "t")]
        assert [r.status_code for r in ok] == [200, 200]
        bad = client.post("/v1/completions", json={**body, "preset": "nope"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "preset"
        assert "baseline" in bad.json()["error"]["message"]


# ---- end to end ---------------------------------------------------------------------------------
def _tune(cli, model: str | None, out, limit: int = 24, gen_length: int = 32, extra=()) -> dict:
    argv = ["tune", "--task", "arith", "--limit", str(limit), "--holdout", "8", "--candidates", "1", "--budget", "30"]
    argv += list(extra)
    argv += ["--search", "threshold", "block_length", "--dtype", "float32", "--gen-length", str(gen_length)]
    assert cli([*argv, "--block-length", "8", "--out", str(out)] + (["--model", model] if model else [])) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_tune_runs_end_to_end_and_its_preset_is_used(tmp_path, capsys):
    from fastdllm.cli.main import main as cli

    out = tmp_path / "arith.json"
    report = _tune(cli, None, out, limit=12, gen_length=16, extra=["--against", "default", "--metric", "aup"])
    text = capsys.readouterr().out
    # the budget counted from the defaults (with the flags given), and the race read by AUP
    assert report["against"] == "default" and report["metric"] == "aup"
    reference = report["calibration"]["reference"]["config"]
    assert (reference["threshold"], reference["cache"], reference["gen_length"]) == (0.9, "dual", 16)
    assert "frontier of the race (reference on 12 calibration problems" in text and "held out (8 problems" in text
    assert report["format"] == PRESET_FORMAT and report["family"] == "LLaDA" and report["task"] == "arith"
    assert report["calibration"]["problems"] == 12 and report["held_out"]["problems"] == 8
    chosen = report["calibration"]["chosen"]
    assert chosen["drop_upper"] <= 0.30 or report["chosen"] == "reference"
    assert out.with_suffix(".png").stat().st_size > 0
    assert cli(["eval", "--task", "arith", "--limit", "2", "--preset", str(out)]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dream-arith", "sdar-arith", "llada2-arith", "real-layout"])
def test_tune_runs_on_every_embedded_model_and_a_real_layout_checkpoint(model, tmp_path, tiny_llada_dir):
    from fastdllm.cli.main import main as cli

    path = str(tiny_llada_dir) if model == "real-layout" else model
    report = _tune(cli, path, tmp_path / "p.json")
    assert report["config"] and report["held_out"]["problems"] == 8
    assert cli(["eval", "--task", "arith", "--limit", "2", "--model", path, "--preset", str(tmp_path / "p.json")]) == 0


@pytest.mark.slow
def test_lm_eval_and_bench_take_a_preset_file(tmp_path, tiny_llada_dir, capsys):
    from fastdllm import lm_eval_plugin
    from fastdllm.cli.main import main as cli

    from .test_eval import _FakeLM

    p = _preset(tmp_path / "tuned.json", threshold=0.6, block_length=16, gen_length=32)
    lm = lm_eval_plugin.make_model_class(_FakeLM)(pretrained=str(tiny_llada_dir), preset=str(p), cache="prefix")
    assert (lm.base_config.threshold, lm.base_config.cache, lm.base_config.gen_length) == (0.6, "prefix", 32)
    # a named preset, the model_args on top
    named = lm_eval_plugin.make_model_class(_FakeLM)(pretrained=str(tiny_llada_dir), preset="dparallel", gen_length=64)
    assert named.base_config == GenerationConfig.dparallel(gen_length=64)
    wrong = _preset(tmp_path / "dream.json", family="Dream", threshold=0.6)
    with pytest.raises(ConfigError, match="tuned for Dream models"):
        lm_eval_plugin.make_model_class(_FakeLM)(pretrained=str(tiny_llada_dir), preset=str(wrong))
    argv = ["bench", "--limit", "1", "--gen-length", "32", "--rows", "full", "--stop-at-eos", "off"]
    assert cli([*argv, "--no-sweeps", "--no-batch-check", "--preset", str(p), "--out", str(tmp_path / "b")]) == 0
    assert "tuned preset (tuned)" in capsys.readouterr().out


def test_the_held_out_check_stops_at_the_time_budget_after_one_chunk():
    """The held-out check decodes its settings side by side a chunk of problems at a time and stops
    once the time budget is spent (having read at least one chunk), saying so."""
    from fastdllm.tuning.search import TuneResult
    from fastdllm.tuning.tune import check_held_out

    fake = FakeEvaluator({None: set(), 0.9: set()}, {None: 100, 0.9: 8})
    chosen = Candidate("t0.9", GenerationConfig(threshold=0.9))
    reference = Candidate("reference", GenerationConfig.baseline())
    result = TuneResult(chosen, reference, [chosen], [], [1], False, 0.0)
    said = []
    spent = check_held_out(result, fake, list(range(200)), [chosen], 0.9, 0.01, deadline=0.0, log=said.append, chunk=64)
    assert spent["problems"] == 64 and any("held-out check read 64 of 200" in s for s in said)
    whole = check_held_out(result, fake, list(range(200)), [chosen], 0.9, 0.01, log=said.append, chunk=64)
    assert whole["problems"] == 200 and whole["rows"]["chosen"]["accuracy"] == 1.0


def test_a_default_that_left_the_race_early_still_bounds_the_choice():
    """The default, over budget at the first rung, is never decoded again; the one setting certified
    at the end is slower than it: the default stays, compared on the problems both decoded (the
    embedded model's default, run out of time at rung 2, was handed back as the reference)."""
    n = 400
    wrong = {None: set(), 0.9: set(range(0, n, 10)), 0.5: set(range(0, n, 8)), 0.99: set()}
    cost = {None: 100, 0.9: 8, 0.5: 2, 0.99: 50}
    pool = [Candidate("default", GenerationConfig(threshold=0.9))]
    pool += [Candidate(f"t{t}", GenerationConfig(threshold=t)) for t in (0.5, 0.99)]
    result = Race(FakeEvaluator(wrong, cost), GenerationConfig.baseline(), pool, list(range(n)), budget=0.02).run()
    by = {c.label: c for c in pool}
    assert len(by["default"].records) < n and by["t0.99"].interval.within(0.02)
    assert result.kept_default and result.chosen.label == "default"
    assert result.indices and all(i in by["default"].records for i in result.indices)  # its evidence
