"""Read a source checkpoint's metadata (config, index, shard headers) and plan the output.

Everything a conversion needs to know is decided here from headers alone, before any
tensor data is read: which op each tensor gets, the exact output shapes and byte counts
(for the disk preflight), and which problems stop the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .blockscale import BLOCK, MXFP4_GROUP, BadTensorData, fp8_source_block
from .rules import OP_DTYPES, Rule, RuleSet
from .safetensors_io import CheckpointError, Header, read_header, tensor_nbytes

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


class PlanError(CheckpointError):
    """The source checkpoint cannot be converted as it is; the message says why and what
    to do."""


@dataclass(frozen=True)
class OutTensor:
    """One output tensor and where its bytes come from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    op: str  # "copy", "weight", "scale"
    group: str
    src: str  # source tensor (weight for op=weight/scale)
    src_scale: str | None = None
    src_block: int = 0  # fp8_reblock: 32 or 128

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


@dataclass
class ShardPlan:
    name: str
    tensors: list[OutTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class Plan:
    src: Path
    config: dict
    headers: dict[str, Header]  # shard file name -> header
    where: dict[str, str]  # tensor name -> source shard file name
    shards: list[ShardPlan]
    other_files: list[str]  # non-weight files to copy, relative to src
    unmatched_kept: list[str]

    @property
    def bytes_in(self) -> int:
        return sum(h.file_size for h in self.headers.values())

    def shard_src_bytes(self, shard: str) -> int:
        return self.headers[shard].file_size


def load_config(src: Path, model_types: tuple[str, ...]) -> dict:
    p = src / CONFIG
    if not p.is_file():
        raise PlanError(f"{p}: missing; SRC must be the model directory with its config.json")
    try:
        cfg = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{p}: not valid JSON ({e})") from None
    mt = cfg.get("model_type") if isinstance(cfg, dict) else None
    if mt not in model_types:
        raise PlanError(
            f"{p}: model_type {mt!r} is not a DeepSeek-V4.1/V4 config (expected one of "
            f"{list(model_types)}); pass --rules for another model"
        )
    return cfg


def _read_index(src: Path) -> tuple[dict[str, str], list[str]]:
    p = src / INDEX
    if p.is_file():
        try:
            wm = json.loads(p.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise PlanError(f"{p}: not a valid safetensors index (no weight_map)") from None
        shards = sorted(set(wm.values()))
        for s in shards:
            if not (src / s).is_file():
                raise PlanError(
                    f"{p}: names shard {s!r}, which is missing from {src}; re-download it"
                )
        return dict(wm), shards
    single = sorted(x.name for x in src.glob("*.safetensors"))
    if not single:
        raise PlanError(f"{src}: no {INDEX} and no *.safetensors files")
    if len(single) > 1:
        raise PlanError(f"{src}: {len(single)} shards but no {INDEX}; restore the index file")
    return {}, single


def _out_shape_scale(shape: tuple[int, ...]) -> tuple[int, int]:
    n, k = shape
    return (-(-n // BLOCK), -(-k // BLOCK))


def _plan_pair(rule: Rule, w: str, wh, sname: str, sh) -> list[OutTensor]:
    wdt, sdt = OP_DTYPES[rule.op]
    if wh.dtype not in wdt:
        raise PlanError(f"tensor {w!r} has dtype {wh.dtype}, rule {rule.name} needs {sorted(wdt)}")
    if sh.dtype not in sdt:
        raise PlanError(
            f"scale {sname!r} has dtype {sh.dtype}, rule {rule.name} needs {sorted(sdt)}"
        )
    if len(wh.shape) != 2 or len(sh.shape) != 2:
        raise PlanError(f"tensor {w!r}: expected 2-D weight and scale, got {wh.shape}, {sh.shape}")
    if rule.op == "mxfp4_to_fp8":
        n, half_k = wh.shape
        k = 2 * half_k
        if k % MXFP4_GROUP or sh.shape != (n, k // MXFP4_GROUP):
            raise PlanError(
                f"scale {sname!r} has shape {list(sh.shape)}, expected [{n}, {k // MXFP4_GROUP}] "
                f"for MXFP4 weight {w!r} {list(wh.shape)}"
            )
        shape, block = (n, k), 0
    else:
        shape = wh.shape
        try:
            block = fp8_source_block(shape, sh.shape)
        except BadTensorData as e:
            raise PlanError(f"scale {sname!r}: {e}") from None
    return [
        OutTensor(w, "F8_E4M3", shape, "weight", rule.name, w, sname, block),
        OutTensor(sname, "F32", _out_shape_scale(shape), "scale", rule.name, w, sname, block),
    ]


def make_plan(src: Path, rules: RuleSet, keep_unmatched: bool = False) -> Plan:
    src = Path(src)
    if not src.is_dir():
        raise PlanError(f"{src}: not a directory; SRC is the model directory")
    config = load_config(src, rules.config.model_types)
    index, shard_names = _read_index(src)
    headers = {s: read_header(src / s) for s in shard_names}
    where = _locate(src, index, headers)
    info = {n: headers[s].tensors[n] for n, s in where.items()}
    decided, consumed = _decide(rules, info, where)

    unmatched = sorted(n for n in info if n not in decided and n not in consumed)
    if unmatched and not keep_unmatched:
        shown = ", ".join(unmatched[:8]) + (" ..." if len(unmatched) > 8 else "")
        raise PlanError(
            f"{len(unmatched)} tensor(s) match no rule in {rules.path}: {shown}; add a rule, "
            "or pass --keep-unmatched to copy them as they are"
        )

    out: dict[str, ShardPlan] = {s: ShardPlan(s) for s in shard_names}
    for s, h in headers.items():
        for name, t in h.tensors.items():
            if name in consumed:
                continue
            rule, sname = decided.get(name, (None, None))
            if rule is None or rule.op == "keep":
                group = rule.name if rule else "unmatched"
                out[s].tensors.append(OutTensor(name, t.dtype, t.shape, "copy", group, name))
                if sname:
                    st = info[sname]
                    out[s].tensors.append(
                        OutTensor(sname, st.dtype, st.shape, "copy", group, sname)
                    )
            else:
                out[s].tensors.extend(_plan_pair(rule, name, t, sname, info[sname]))

    weight_files = {INDEX, CONFIG, *shard_names}
    others = sorted(
        str(p.relative_to(src))
        for p in src.rglob("*")
        if p.is_file()
        and str(p.relative_to(src)) not in weight_files
        and not p.name.endswith(".safetensors")
        and ".vllm-h20" not in p.parts
    )
    return Plan(src, config, headers, where, list(out.values()), others, unmatched)


def _locate(src: Path, index: dict[str, str], headers: dict) -> dict[str, str]:
    """Which shard holds each tensor; refuses a tensor in two shards and, with an index, an
    indexed tensor missing from its shard or a stored one the index does not name."""
    where: dict[str, str] = {}
    for s, h in headers.items():
        for name in h.tensors:
            if name in where:
                raise PlanError(f"tensor {name!r} appears in both {where[name]} and {s}")
            where[name] = s
    if index:
        missing = sorted(set(index) - set(where))
        if missing:
            raise PlanError(
                f"{src / INDEX}: {len(missing)} indexed tensor(s) not in their shard, e.g. "
                f"{missing[0]!r} in {index[missing[0]]}; the shard is incomplete"
            )
        extra = sorted(set(where) - set(index))
        if extra:
            raise PlanError(
                f"{src / INDEX}: tensor {extra[0]!r} in {where[extra[0]]} is not indexed"
            )
    return where


def _decide(
    rules: RuleSet, info: dict, where: dict[str, str]
) -> tuple[dict[str, tuple[Rule | None, str | None]], dict[str, str]]:
    """The first matching rule of each tensor, and which scales their weights consume
    (a converted weight without its scale is refused)."""
    decided: dict[str, tuple[Rule | None, str | None]] = {}  # name -> (rule, scale name)
    consumed: dict[str, str] = {}  # scale -> weight
    for name, t in info.items():
        if name in consumed:
            continue
        rule = rules.first_match(name, t.dtype)
        if rule is None:
            continue
        sname = rule.scale_name(name)
        if rule.op != "keep" or (sname and sname in info):
            if sname is None or sname not in info:
                raise PlanError(
                    f"weight {name!r} ({where[name]}) has no scale {sname!r}; the checkpoint is "
                    "incomplete (re-download the shard)"
                )
            if sname in decided:
                del decided[sname]
            consumed[sname] = name
        decided[name] = (rule, sname if sname in consumed else None)
    return decided, consumed
