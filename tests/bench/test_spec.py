"""Sweep specs: the shipped ones carry the seed's method; bad ones fail naming file and key."""

from __future__ import annotations

import pytest

from vllm_h20.bench import spec as spec_mod
from vllm_h20.bench.spec import SpecError


def test_shipped_decode_is_the_seed_method():
    s = spec_mod.load("decode")
    assert s.concurrency == (1, 8, 32, 64, 128, 256)
    assert (s.warmup_s, s.measure_s, s.runs) == (10, 80, 3)
    assert (s.request.output_tokens, s.request.temperature) == (1024, 0.7)
    assert s.throughput == "output"


def test_shipped_prefill_is_the_seed_method():
    s = spec_mod.load("prefill")
    assert s.concurrency == (1, 8, 32, 64)
    assert (s.warmup_s, s.measure_s, s.runs) == (10, 50, 3)
    assert (s.request.prompt_tokens, s.request.output_tokens) == (1024, 1)
    assert s.throughput == "input"


def test_run_seeds_differ_per_tier_and_run_but_not_per_target():
    s = spec_mod.load("decode")
    seeds = {s.run_seed(c, r) for c in s.concurrency for r in range(s.runs)}
    assert len(seeds) == len(s.concurrency) * s.runs


def test_fingerprint_ignores_comments_but_not_the_method(tmp_path):
    base = spec_mod.shipped_sweeps().joinpath("prefill.yaml").read_text()
    a, b, c = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    a.write_text(base)
    b.write_text("# another comment\n" + base)
    c.write_text(base.replace("measure_s: 50", "measure_s: 40"))
    fa, fb, fc = (spec_mod.fingerprint(spec_mod.load(p)) for p in (a, b, c))
    assert fa == fb != fc


@pytest.mark.parametrize(
    "edit, message",
    [
        (("runs: 3", "runns: 3"), "unknown key `runns`; did you mean `runs`?"),
        (
            ("prompt_tokens: 1024", "prompt_tokens: many"),
            "`request.prompt_tokens` must be an integer",
        ),
        (("concurrency: [1, 8, 32, 64]", "concurrency: [1, 8, 8]"), "lists a tier twice"),
        (("concurrency: [1, 8, 32, 64]", "concurrency: []"), "non-empty list"),
        (("throughput: input", "throughput: both"), "`throughput` must be `output`"),
        (("format: /v1/completions", "format: /v2/x"), "`request.format` must be one of"),
        (("measure_s: 50", "measure_s: -1"), "`measure_s` must be a number >= 1"),
        (("output_tokens: 1", "outptu_tokens: 1"), "request: unknown key `outptu_tokens`"),
        (("name: prefill", "name: [x]"), "`name` must be a word"),
    ],
)
def test_bad_specs_name_file_and_key(tmp_path, edit, message):
    text = spec_mod.shipped_sweeps().joinpath("prefill.yaml").read_text()
    assert edit[0] in text
    p = tmp_path / "bad.yaml"
    p.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(SpecError) as e:
        spec_mod.load(p)
    assert str(p) in str(e.value) and message in str(e.value)


def test_missing_key_invalid_yaml_and_unknown_name(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("name: x\nrequest: {prompt_tokens: 1, output_tokens: 1}\nconcurrency: [1]\n")
    with pytest.raises(SpecError, match="missing key `measure_s`"):
        spec_mod.load(p)
    p.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match=r"s.yaml:\d+: not valid YAML"):
        spec_mod.load(p)
    with pytest.raises(SpecError, match="shipped: decode, prefill"):
        spec_mod.load("decodee")
