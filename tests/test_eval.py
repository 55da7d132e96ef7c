"""The evaluation harness: data loading and errors, metrics, the CLI, sharding over ranks."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastdllm.cli import main as cli
from fastdllm.config import GenerationConfig
from fastdllm.evaluation.harness import evaluate, parse_indices, summarize
from fastdllm.evaluation.tasks import DATA_DIR, DataError, UnknownTaskError, get_task, read_jsonl

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SMALL = GenerationConfig(gen_length=32, block_length=16)


def run_cli(*args, timeout=600, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "fastdllm", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout
    )


# ---- data and bad input ------------------------------------------------------------------------
def test_bundled_data_sizes():
    assert {p.name for p in DATA_DIR.glob("*.gz")} == {
        "gsm8k_test.jsonl.gz",
        "gsm8k_train.jsonl.gz",
        "HumanEval.jsonl.gz",
        "mbpp.jsonl.gz",
        "math500_test.jsonl.gz",
        "gsm8k_train_easy.jsonl.gz",
        "docstrings.jsonl.gz",
    }
    assert (DATA_DIR / "README.md").is_file()
    assert len(read_jsonl("gsm8k_train")) == 8
    for name, n in (
        ("gsm8k", 1319),
        ("math500", 500),
        ("humaneval", 164),
        ("mbpp", 500),
        ("arith", 1000),
        ("everyday", 500),
        ("everyday-probe", 32),
    ):
        assert len(get_task(name).load()) == n


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="no ../shared/data here")
def test_bundled_data_matches_sources_and_data_dir_reads_plain_files():
    for name in ("gsm8k_test.jsonl", "math500_test.jsonl", "mbpp.jsonl"):
        ours = gzip.open(DATA_DIR / (name + ".gz")).read()
        assert hashlib.sha256(ours).digest() == hashlib.sha256((SHARED_DATA / name).read_bytes()).digest()
    for name in ("gsm8k", "math500", "mbpp", "humaneval"):
        task = get_task(name)
        assert [d.data for d in task.load(SHARED_DATA, limit=20)] == [d.data for d in task.load(limit=20)]
    gsm = get_task("gsm8k")
    assert gsm.fewshot(8, SHARED_DATA) == gsm.fewshot(8)  # full train split: the same first 8 rows


def test_unknown_task(capsys):
    with pytest.raises(UnknownTaskError, match="unknown task 'nope'.*gsm8k"):
        get_task("nope")
    assert cli.main(["eval", "--task", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'nope'" in err and "Traceback" not in err


def test_missing_data_file(tmp_path, capsys):
    with pytest.raises(DataError, match="gsm8k_test.jsonl.gz: missing data file"):
        get_task("gsm8k").load(tmp_path)
    assert cli.main(["eval", "--task", "humaneval", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "HumanEval.jsonl.gz") in err and "Traceback" not in err


def test_malformed_jsonl_line(tmp_path, capsys):
    good = json.dumps({"question": "1 + 1?", "answer": "2\n#### 2"})
    (tmp_path / "gsm8k_test.jsonl").write_text(good + "\n{not json\n")
    with pytest.raises(DataError, match=r"gsm8k_test.jsonl:2: malformed JSON line"):
        get_task("gsm8k").load(tmp_path)
    assert cli.main(["eval", "--task", "gsm8k", "--num-fewshot", "0", "--data-dir", str(tmp_path)]) == 2
    assert "gsm8k_test.jsonl:2: malformed JSON line" in capsys.readouterr().err
    # a missing field, and a broken gzip file
    (tmp_path / "gsm8k_test.jsonl").write_text(good + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DataError, match=r"gsm8k_test.jsonl:2: missing field 'answer'"):
        get_task("gsm8k").load(tmp_path)
    (tmp_path / "math500_test.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="math500_test.jsonl.gz: cannot be read"):
        get_task("math500").load(tmp_path)


def test_bad_options(capsys):
    assert cli.main(["eval", "--task", "gsm8k", "--num-fewshot", "9"]) == 2
    assert "num_fewshot" in capsys.readouterr().err
    assert cli.main(["eval", "--task", "arith", "--limit", "0"]) == 2
    assert "--limit" in capsys.readouterr().err
    assert cli.main(["eval", "--task", "arith", "--threshold", "2"]) == 2
    assert "--threshold" in capsys.readouterr().err


# ---- prompts -----------------------------------------------------------------------------------
def test_arith_prompts_are_the_training_prompts(tokenizer):
    from fastdllm.evaluation.tasks import arith
    from fastdllm.evaluation.tasks.arith import prompt_ids

    task = get_task("arith")
    doc = task.load(limit=1)[0]
    for k in (0, 3):
        shots = task.fewshot(k)
        assert task.encode(tokenizer, doc, shots) == prompt_ids(
            tokenizer, doc.data["question"], arith.fewshot_exemplars(k)
        )


def test_prompt_formats(tokenizer):
    gsm = get_task("gsm8k")
    doc = gsm.load(limit=1)[0]
    text = gsm.prompt_text(doc, gsm.fewshot(5))
    assert text.count("Question:") == 6 and text.endswith("Answer:") and text.count("####") == 5
    assert len(gsm.fewshot(8)) == 8
    math = get_task("math500")
    text = math.prompt_text(math.load(limit=1)[0], math.fewshot(4))
    assert text.count("Problem:") == 5 and text.endswith("Solution:") and text.count("I hope it is correct.") == 4
    mbpp = get_task("mbpp")
    text = mbpp.prompt_text(mbpp.load(limit=1)[0], mbpp.fewshot(3))
    assert text.count("[BEGIN]") == 4 and text.count("[DONE]") == 3 and text.endswith("[BEGIN]\n")
    he = get_task("humaneval")
    hdoc = he.load(limit=1)[0]
    assert he.prompt_text(hdoc, []) == hdoc.data["prompt"]
    # chat models get their chat template; plain models the text itself
    assert tokenizer.chat_template
    assert gsm.encode(tokenizer, doc, []) == tokenizer.encode_chat(
        [{"role": "user", "content": gsm.prompt_text(doc, [])}]
    )

    class Plain:
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            return [len(text)]

    assert gsm.encode(Plain(), doc, []) == [len(gsm.prompt_text(doc, []))]
    assert he.stop_strings(chat=False)[0] == "\ndef " and he.stop_strings(chat=True) == []
    # a chat model's prompts as plain text, on request
    arith_task = get_task("arith")
    adoc = arith_task.load(limit=1)[0]
    assert arith_task.encode(tokenizer, adoc, [], chat=False) == tokenizer.encode(
        f"Question: {adoc.data['question']}\nAnswer:"
    )
    assert he.encode(tokenizer, hdoc, [], chat=False) == tokenizer.encode(hdoc.data["prompt"])


# ---- metrics and the Python API ----------------------------------------------------------------
def test_summarize_definitions():
    records = [
        {"num_tokens": 10, "nfe": 5, "revealed": 20, "correct": True, "verdict": "correct"},
        {"num_tokens": 30, "nfe": 15, "revealed": 40, "correct": False, "verdict": "wrong"},
    ]
    timings = [
        {"generation_time_s": 2.0, "scoring_time_s": 1.0, "total_time_s": 4.0},
        {"generation_time_s": 6.0, "scoring_time_s": 1.0, "total_time_s": 8.0},
    ]
    m = summarize(records, timings)
    assert m["accuracy"] == 0.5 and m["correct"] == 1
    assert m["tokens_per_second"] == 40 / 8.0  # summed tokens / summed generation time
    assert m["aggregate_tokens_per_second"] == 40 / 6.0  # / the slowest rank
    assert m["nfe_per_sample"] == 10 and m["tokens_per_step"] == 60 / 20
    assert m["verdicts"] == {"correct": 1, "wrong": 1}


def _key(records):
    keep = ("index", "id", "output", "extracted", "verdict", "correct", "num_tokens", "nfe", "revealed")
    return [{k: r[k] for k in keep} for r in records]


def test_evaluate_api_and_batch_invariance(tiny_llada, tokenizer, tmp_path):
    log = tmp_path / "samples.jsonl"
    one = evaluate(tiny_llada, tokenizer, "arith", limit=5, config=SMALL, batch_size=1, log_samples=log)
    three = evaluate(tiny_llada, tokenizer, "arith", limit=5, config=SMALL, batch_size=3)
    for key in ("accuracy", "tokens_per_second", "nfe_per_sample", "tokens_per_step", "num_samples", "samples"):
        assert key in one
    assert one["num_samples"] == 5 and one["config"]["gen_length"] == 32
    assert _key(one["samples"]) == _key(three["samples"])
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(5))
    for field in ("prompt", "output", "extracted", "gold", "verdict", "nfe", "time_s", "num_tokens"):
        assert field in lines[0]
    assert (
        lines[0]["prompt"].startswith(tokenizer.bos_token)
        and lines[0]["gold"] == get_task("arith").load(limit=1)[0].gold
    )
    total = sum(x["num_tokens"] for x in lines)
    assert one["generated_tokens"] == total
    assert one["tokens_per_second"] == pytest.approx(total / one["generation_time_s"])


def test_evaluate_code_and_math_plumbing(tiny_llada, tokenizer):
    he = evaluate(tiny_llada, tokenizer, "humaneval", limit=2, config=SMALL, workers=2, timeout=5)
    assert he["num_samples"] == 2 and "pass@1" in he and "sandbox_protections" in he
    assert all(s["verdict"] in ("passed", "failed", "timeout", "crashed") for s in he["samples"])
    # the logged program is the solution alone: the tests never ran beside it
    assert all(
        f"def {d}(" in s["extracted"] and "check(" not in s["extracted"]
        for s, d in zip(he["samples"], ("has_close_elements", "separate_paren_groups"))
    )
    m = evaluate(tiny_llada, tokenizer, "math500", limit=2, num_fewshot=0, config=SMALL)
    assert m["num_samples"] == 2 and m["equivalence_backend"] == "math_verify"


# ---- the command line, end to end ----------------------------------------------------------------
@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    out, log = tmp_path / "results.json", tmp_path / "samples.jsonl"
    r = run_cli(
        "eval",
        "--task",
        "arith",
        "--limit",
        "16",
        "--gen-length",
        "128",
        "--output",
        str(out),
        "--log-samples",
        str(log),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("accuracy", "tokens_per_second", "nfe_per_sample", "tokens_per_step"):
        assert isinstance(res[key], (int, float))
    assert res["num_samples"] == 16 and res["task"] == "arith" and res["config"]["gen_length"] == 128
    assert res["tokens_per_second"] > 0 and res["nfe_per_sample"] > 0
    assert len(log.read_text().splitlines()) == 16
    assert "accuracy" in r.stdout and "tokens/s" in r.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not found")
def test_two_ranks_match_one_process(tmp_path):
    common = [
        "eval",
        "--task",
        "arith",
        "--limit",
        "8",
        "--gen-length",
        "64",
        "--batch-size",
        "2",
        "--no-progress",
        "--dtype",
        "float32",
    ]  # batch composition differs per rank: exact only in fp32
    single = run_cli(*common, "--log-samples", str(tmp_path / "one.jsonl"), "--output", str(tmp_path / "one.json"))
    assert single.returncode == 0, single.stderr[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    multi = subprocess.run(
        [
            shutil.which("torchrun"),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "fastdllm",
            *common,
            "--log-samples",
            str(tmp_path / "two.jsonl"),
            "--output",
            str(tmp_path / "two.json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert multi.returncode == 0, multi.stderr[-3000:]
    one = [json.loads(x) for x in (tmp_path / "one.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert _key(one) == _key(two)
    assert {x["rank"] for x in two} == {0, 1}
    r1, r2 = json.loads((tmp_path / "one.json").read_text()), json.loads((tmp_path / "two.json").read_text())
    assert r2["world_size"] == 2 and r1["world_size"] == 1
    for key in ("accuracy", "nfe_per_sample", "tokens_per_step", "generated_tokens"):
        assert r1[key] == r2[key]
    assert multi.stdout.count("accuracy") == 1  # only rank 0 prints


# ---- the lm-evaluation-harness plugin (logic tested on a stand-in for lm_eval's LM base) -------
class _FakeLM:
    def __init__(self):
        self._rank, self._world_size = 0, 1

        class Hook:
            def add_partial(self, *a):
                pass

        self.cache_hook = Hook()

    @property
    def rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world_size


class _Req:
    def __init__(self, *args):
        self.args = args


def test_lm_eval_plugin_logic(tiny_llada_dir, tokenizer):
    from fastdllm import lm_eval_plugin

    registered = {}

    def register_model(name):
        def deco(cls):
            registered[name] = cls
            return cls

        return deco

    cls = lm_eval_plugin.make_model_class(_FakeLM, register_model)
    assert registered == {"fastdllm": cls}
    with pytest.raises(ValueError, match="unknown model_args bogus"):
        cls(pretrained=str(tiny_llada_dir), bogus=1)
    with pytest.raises(ValueError, match="threshold"):
        cls(pretrained=str(tiny_llada_dir), threshold=3.0)
    lm = cls(
        pretrained=str(tiny_llada_dir), device="cuda", threshold="none", cache="prefix", block_length=16, batch_size="2"
    )
    assert lm.base_config.threshold is None and lm.base_config.cache == "prefix" and lm.batch_size == 2
    assert lm._config_for({"max_gen_toks": 20}).gen_length == 32  # rounded up to whole blocks
    with pytest.raises(ValueError, match="mc_num"):
        cls(pretrained=str(tiny_llada_dir), mc_num=10, mc_batch_size=4)
    prompts = ["Question: Tom has 5 apples.\nAnswer:", "Question: Ann has 3 pens. She buys 2 more.\nAnswer:"]
    reqs = [_Req(p, {"until": ["Question:"], "max_gen_toks": 16}) for p in prompts]
    out = lm.generate_until(reqs, disable_tqdm=True)
    assert len(out) == 2 and all(isinstance(o, str) and "Question:" not in o for o in out)
    # the same as our engine on each prompt alone
    from fastdllm.engine.generation import generate
    from fastdllm.text.completion import complete

    for p, o in zip(prompts, out):
        seq = generate(lm.model, [lm.tokenizer.encode(p)], config=lm._config_for({"max_gen_toks": 16})).sequences[0]
        assert complete(lm.tokenizer, seq, lm.model.stop_token_ids, stop=["Question:"]).text == o
    assert lm.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("assistant<|end_header_id|>\n\n")
    # infilling from model_args, as lm-eval passes them (text)
    fill = cls(pretrained=str(tiny_llada_dir), block_length=16, fixed="3: apples", suffix=" The end.")
    assert fill.base_config.fixed == ((3, " apples"),) and fill.base_config.suffix == " The end."
    texts = fill.generate_until([_Req(p, {"until": [], "max_gen_toks": 16}) for p in prompts], disable_tqdm=True)
    assert all(" apples" in t for t in texts)


def test_lm_eval_plugin_registers_with_lm_eval():
    pytest.importorskip("lm_eval")
    from lm_eval.api.registry import get_model

    from fastdllm import lm_eval_plugin

    assert get_model("fastdllm") is lm_eval_plugin.register()


@pytest.mark.slow
def test_the_readmes_lm_eval_example_runs_as_written(tmp_path):
    """The README's lm-eval command, word for word, offline: lm-eval's own CLI, our model, the
    shipped `fastdllm_arith` task; the embedded model solves its 20 problems."""
    pytest.importorskip("lm_eval")
    import re
    import shlex

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL) if "fastdllm.lm_eval_plugin" in b)
    line = next(c for c in block.replace("\\\n", " ").splitlines() if "fastdllm.lm_eval_plugin" in c)
    argv = shlex.split(line.split("#")[0])
    assert argv[:3] == ["python", "-m", "fastdllm.lm_eval_plugin"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, *argv[1:]], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("|fastdllm_arith"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "exact_match" and float(cells[6]) >= 0.9, row


@pytest.mark.slow
def test_elbo_loglikelihood_ranks_and_converges():
    """On the embedded model: the right worked answer is far likelier than one with a wrong final
    number, and the estimate's spread over seeds shrinks as mc_num grows."""
    import statistics

    import fastdllm
    from fastdllm import lm_eval_plugin
    from fastdllm.engine.likelihood import elbo_loglikelihood
    from fastdllm.evaluation.tasks import arith

    model, tok = fastdllm.load(dtype="float32")
    p = arith.test_split()[0]
    prefix = arith.prompt_ids(tok, p.question, [])
    right = tok.encode(p.answer)
    wrong = tok.encode(p.answer.replace(f"#### {p.value}", f"#### {p.value + 7}"))
    assert right != wrong
    few = [elbo_loglikelihood(model, prefix, right, mc_num=8, batch_size=8, seed=s) for s in range(4)]
    many = [elbo_loglikelihood(model, prefix, right, mc_num=64, batch_size=16, seed=s) for s in range(4)]
    bad = [elbo_loglikelihood(model, prefix, wrong, mc_num=64, batch_size=16, seed=s) for s in range(4)]
    assert statistics.pstdev(many) < statistics.pstdev(few)
    assert max(bad) < min(many)
    assert elbo_loglikelihood(model, prefix, right, 16, 8, seed=3) == elbo_loglikelihood(
        model, prefix, right, 16, 8, seed=3
    )
    with pytest.raises(ValueError, match="batch_size"):
        elbo_loglikelihood(model, prefix, right, mc_num=10, batch_size=4)
    # through the lm-eval model class: multiple choice picks the right answer
    lm = lm_eval_plugin.make_model_class(_FakeLM)(mc_num=32, mc_batch_size=16)
    question = "Question: " + p.question + "\nAnswer:"
    (ll_right, _), (ll_wrong, _) = lm.loglikelihood(
        [_Req(question, " " + p.answer), _Req(question, " " + tok.decode(wrong))]
    )
    assert ll_right > ll_wrong
    assert len(lm.loglikelihood_rolling([_Req("Tom has 5 apples.")])) == 1


def test_samples_selects_documents_by_index(tiny_llada, tokenizer):
    m, tok = tiny_llada, tokenizer
    cfg = GenerationConfig(gen_length=32, block_length=16)
    picked = evaluate(m, tok, "arith", samples=[7, 3], config=cfg)
    assert [r["index"] for r in picked["samples"]] == [3, 7] and picked["sample_indices"] == [3, 7]
    first = evaluate(m, tok, "arith", limit=8, config=cfg)
    same = {r["index"]: r["output"] for r in first["samples"]}
    assert all(r["output"] == same[r["index"]] for r in picked["samples"])
    with pytest.raises(ValueError, match="samples"):
        evaluate(m, tok, "arith", samples=[3], limit=4, config=cfg)
    with pytest.raises(ValueError, match="samples"):
        evaluate(m, tok, "arith", samples=[10**9], config=cfg)
    assert parse_indices("0-2, 9") == [0, 1, 2, 9]
    with pytest.raises(ValueError, match="samples"):
        parse_indices("5-2")
