"""The module names of the model a config builds, without building it (torch-free, no weights), and the
rules for every config value that names a module: ``adapter.targets`` and ``quant.skip_modules``.

A value that names no module fails late and far from its cause (PEFT raises ``Target modules ... not
found`` after the model is loaded; a ``quant.skip_modules`` entry that matches nothing is silently ignored
and the module gets quantised). These rules run with the other cross-knob rules
(:func:`vramsweep.config.compose.check_rules`, levels ``config`` and ``all``), so every verb refuses such a
value before anything is built, naming the key and the module names that exist.

The names come from the architecture: ``model.family`` for ``model.source=embedded|arch``, the
``model_type`` of ``<model.path>/config.json`` for ``model.source=path``. The decoder families we build
(Llama/Mistral/Qwen2/Qwen3: :data:`KNOWN_FAMILIES`) share one naming; ``tests/knobs/test_modules.py`` compares
the table with ``named_modules()`` of models instantiated on the meta device. A model type outside the
table is not checked here (nothing is guessed).

Matching is the libraries' own:

* ``adapter.targets`` as a list (PEFT): a module is adapted when its dotted name equals an entry or ends
  with ``.<entry>``; as a string other than ``all-linear``: a regular expression that must match the whole
  dotted name (``re.fullmatch``). LoRA adapts ``Linear`` and ``Embedding`` modules only; PEFT refuses any
  other module a target matches.
* ``quant.skip_modules`` (transformers' bitsandbytes quantiser): a ``Linear`` is left unquantised when its
  name starts with the pattern (a regular expression, ``re.match``) or ends with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramsweep.config.errors import ConfigError

#: Kinds of module in :class:`ModuleTable`.
LINEAR, EMBEDDING, NORM, CONTAINER, OTHER = "Linear", "Embedding", "RMSNorm", "container", "other"
#: What LoRA can adapt (PEFT: ``Linear``, ``Embedding``; convolutions do not occur in these decoders).
LORA_KINDS = (LINEAR, EMBEDDING)
#: ``model_type`` values whose modules follow the Llama naming below.
KNOWN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: Projections of one decoder layer, in forward order (the same as :data:`vramsweep.estimate.dims.LINEARS`).
ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModuleTable:
    """``{dotted module name: kind}`` of a ``<Family>ForCausalLM`` (the names ``named_modules()`` gives)."""

    family: str
    modules: dict[str, str]

    def names(self, *kinds: str) -> list[str]:
        return [n for n, k in self.modules.items() if not kinds or k in kinds]

    def short_names(self, *kinds: str) -> list[str]:
        """The last component of each name (what a PEFT target list usually holds), first-seen order."""
        return list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in self.names(*kinds)))


def module_table(family: str, num_layers: int) -> ModuleTable:
    """The module names of a Llama-naming decoder with ``num_layers`` layers (Qwen3 adds q/k norms)."""
    m: dict[str, str] = {"": CONTAINER, "model": CONTAINER, "model.embed_tokens": EMBEDDING}
    m["model.layers"] = CONTAINER
    for i in range(int(num_layers)):
        p = f"model.layers.{i}"
        m[p] = CONTAINER
        m[f"{p}.self_attn"] = CONTAINER
        for n in ATTN_PROJ:
            m[f"{p}.self_attn.{n}"] = LINEAR
        if family == "qwen3":
            m[f"{p}.self_attn.q_norm"] = NORM
            m[f"{p}.self_attn.k_norm"] = NORM
        m[f"{p}.mlp"] = CONTAINER
        for n in MLP_PROJ:
            m[f"{p}.mlp.{n}"] = LINEAR
        m[f"{p}.mlp.act_fn"] = OTHER
        m[f"{p}.input_layernorm"] = NORM
        m[f"{p}.post_attention_layernorm"] = NORM
    m["model.norm"] = NORM
    m["model.rotary_emb"] = OTHER
    m["lm_head"] = LINEAR
    return ModuleTable(family=family, modules=m)


def _path_arch(path: str) -> tuple[str, int] | None:
    """``(model_type, num_hidden_layers)`` of ``<path>/config.json``; None when unreadable, a wrapper
    (``text_config``: other naming) or a type outside :data:`KNOWN_FAMILIES` (the loader or
    :func:`vramsweep.estimate.dims.check_model_config` names an unreadable file)."""
    try:
        with open(Path(path) / "config.json", encoding="utf-8") as fh:
            raw = json.load(fh)
        if not isinstance(raw, dict) or "text_config" in raw:
            return None
        kind = str(raw.get("model_type", ""))
        layers = int(raw["num_hidden_layers"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if kind not in KNOWN_FAMILIES or not 0 < layers <= 10_000:
        return None
    return kind, layers


def model_modules(cfg: Any) -> ModuleTable | None:
    """The :class:`ModuleTable` of the model ``cfg`` builds, or None when its naming is not known here."""
    m = cfg.model
    if str(m.source) == "path":
        if not m.get("path"):
            return None
        arch = _path_arch(str(m.path))
        return module_table(*arch) if arch else None
    family = str(m.family)
    if family not in KNOWN_FAMILIES:
        return None
    try:
        layers = int(m.num_layers)
    except (TypeError, ValueError):
        return None
    return module_table(family, layers) if 0 < layers <= 10_000 else None


def _model_label(cfg: Any, table: ModuleTable) -> str:
    m = cfg.model
    if str(m.source) == "path":
        return f"model.path={m.path} ({table.family})"
    return f"model={m.name} ({table.family})"


def _peft_matches(target: str, names: list[str]) -> list[str]:
    return [n for n in names if n == target or n.endswith("." + target)]


def check_adapter_targets(cfg: Any, table: ModuleTable | None = None) -> None:
    """Every ``adapter.targets`` entry names at least one module, and only modules LoRA can adapt."""
    a = cfg.adapter
    if str(a.method) != "lora":
        return
    table = table or model_modules(cfg)
    targets = a.targets
    if table is None or targets is None:
        return
    names = table.names()
    allowed = ["all-linear", *table.short_names(*LORA_KINDS)]
    label = _model_label(cfg, table)
    if isinstance(targets, str):
        if targets == "all-linear" or not targets:  # empty: check_values names it
            return
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise ConfigError(
                f"adapter.targets={targets!r} is not a valid regular expression ({exc}); a list "
                f"matches module names by suffix: adapter.targets=[{targets}]",
                key="adapter.targets",
                allowed=allowed,
            ) from None
        matched = [n for n in names if pattern.fullmatch(n)]
        if not matched:
            raise ConfigError(
                f"adapter.targets={targets!r} matches no module of {label}: a string is a regular expression "
                f"matched against whole module names (e.g. model.layers.0.self_attn.q_proj); a list matches "
                f"by suffix: adapter.targets=[{targets}]",
                key="adapter.targets",
                allowed=allowed,
            )
        _refuse_unsupported(targets, matched, table, label, allowed)
        return
    for t in targets:
        t = str(t)
        matched = _peft_matches(t, names)
        if not matched:
            raise ConfigError(
                f"adapter.targets: {t!r} matches no module of {label} (PEFT adapts a module whose "
                "name equals an entry or ends with '.<entry>')",
                key="adapter.targets",
                allowed=allowed,
            )
        _refuse_unsupported(t, matched, table, label, allowed)


def _refuse_unsupported(
    target: str, matched: list[str], table: ModuleTable, label: str, allowed: list[str]
) -> None:
    bad = [n for n in matched if table.modules[n] not in LORA_KINDS]
    if bad:
        kind = table.modules[bad[0]]
        what = "a container of modules" if kind == CONTAINER else f"a {kind} module"
        raise ConfigError(
            f"adapter.targets: {target!r} matches {bad[0] or '<the whole model>'} of {label}, {what}: LoRA "
            f"adapts Linear and Embedding modules only",
            key="adapter.targets",
            allowed=allowed,
        )


def _skip_matches(pattern: str, names: list[str]) -> list[str]:
    """transformers' ``should_convert_module``: prefix regex (``re.match``) or a name suffix."""
    return [n for n in names if re.match(f"{pattern}\\.", n) or re.match(pattern, n) or n.endswith(pattern)]


def _tied(cfg: Any) -> bool:
    """The model ties ``lm_head`` to the embedding (``<model.path>/config.json`` for ``source=path``)."""
    m = cfg.model
    if str(m.source) != "path":
        return bool(m.get("tie_word_embeddings", False))
    try:
        with open(Path(str(m.path)) / "config.json", encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError, TypeError):
        return False
    return isinstance(raw, dict) and bool(raw.get("tie_word_embeddings", True))


def _valid_re(p: str) -> bool:
    try:
        re.compile(p)
    except re.error:
        return False
    return True


def check_quant_skip(cfg: Any, table: ModuleTable | None = None) -> None:
    """With quantisation on, every ``quant.skip_modules`` entry matches at least one ``Linear``."""
    q = cfg.quant
    if int(q.bits) == 16:
        return
    table = table or model_modules(cfg)
    if table is not None:
        _check_skip_entries(cfg, table)
    skips = [str(p) for p in q.get("skip_modules") or []]
    if _tied(cfg) and not any(p and _skip_matches(p, ["lm_head"]) for p in skips if _valid_re(p)):
        raise ConfigError(  # transformers keeps lm_head unquantised unless given a list without it
            f"quant.skip_modules={skips} quantises lm_head, which is tied to the embedding: "
            "bitsandbytes then fails in the trial; keep 'lm_head' in the list",
            key="quant.skip_modules",
            allowed=["[lm_head] (the default)", "[lm_head, <more modules>]"],
        )


def _check_skip_entries(cfg: Any, table: ModuleTable) -> None:
    q = cfg.quant
    if not q.get("skip_modules"):
        return
    linears = table.names(LINEAR)
    allowed = table.short_names(LINEAR)
    for p in q.skip_modules:
        p = str(p)
        if not p:
            raise ConfigError(
                "quant.skip_modules: an empty entry matches every module (nothing would be quantised)",
                key="quant.skip_modules",
                allowed=allowed,
            )
        try:
            re.compile(p)
        except re.error as exc:
            raise ConfigError(
                f"quant.skip_modules: {p!r} is not a valid regular expression ({exc})",
                key="quant.skip_modules",
                allowed=allowed,
            ) from None
        if not _skip_matches(p, linears):
            raise ConfigError(
                f"quant.skip_modules: {p!r} matches no Linear module of {_model_label(cfg, table)} "
                "(it would be ignored and every Linear quantised)",
                key="quant.skip_modules",
                allowed=allowed,
            )


def check_module_names(cfg: Any) -> None:
    """The module-name rules (``adapter.targets``, ``quant.skip_modules``) against the model's modules."""
    table = model_modules(cfg)
    if table is None:
        return
    check_adapter_targets(cfg, table)
    check_quant_skip(cfg, table)


__all__ = [
    "KNOWN_FAMILIES",
    "LORA_KINDS",
    "ModuleTable",
    "check_adapter_targets",
    "check_module_names",
    "check_quant_skip",
    "model_modules",
    "module_table",
]
