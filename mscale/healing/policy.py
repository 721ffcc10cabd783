"""The healing policy: a validated data file mapping conditions to actions per level.

The shipped default is `mscale/healing/policy.yaml`; `healing.policy` in the agent's config
points at another. A malformed file raises `PolicyError` naming the line at fault, and the
agent refuses to start (exit 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from mscale.findings import Reason
from mscale.healing import actions
from mscale.healing.fsm import Level
from mscale.healing.words import TargetKind
from mscale.textfile import read_text

TARGETS = tuple(TargetKind)
DECIDERS = ("in_process", "agent")
JOB_LEVELS = ("healthy", "cooling")
MPU_LEVELS = tuple(level.value for level in Level)
SEVERITIES = ("critical", "warning", "info")
_RULE_KEYS = {"name", "decide", "reasons", "alerts", "severities", "labels", "target", "actions"}


class PolicyError(ValueError):
    """The policy file is malformed; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class Rule:
    name: str
    decide: str
    target: TargetKind
    reasons: frozenset[str] = frozenset()
    alerts: frozenset[str] = frozenset()
    severities: frozenset[str] = frozenset()
    labels: Mapping[str, str] = field(default_factory=dict)
    actions: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def matches(self, kind: str, name: str, severity: str, labels: Mapping[str, str]) -> bool:
        if kind == "reason":
            if name not in self.reasons:
                return False
            if self.severities and severity not in self.severities:
                return False
        elif name not in self.alerts:
            return False
        return all(labels.get(k) == v for k, v in self.labels.items())

    def actions_at(self, level: str) -> tuple[str, ...]:
        if level in self.actions:
            return self.actions[level]
        return self.actions.get("any", ())


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...]
    dedup_window_s: float = 60.0
    source: str = "<default>"

    def match(self, kind: str, name: str, severity: str = "", labels: Mapping[str, str] | None = None) -> Rule | None:
        """The first rule matching a condition (rules are checked in file order)."""
        labels = labels or {}
        for rule in self.rules:
            if rule.matches(kind, name, severity, labels):
                return rule
        return None

    def rule(self, name: str) -> Rule:
        for r in self.rules:
            if r.name == name:
                return r
        raise KeyError(name)


# --- loading -----------------------------------------------------------------------------


def default_text() -> tuple[str, str]:
    ref = resources.files("mscale.healing") / "policy.yaml"
    return ref.read_text(), "mscale/healing/policy.yaml"


def load(path: str | Path | None = None) -> Policy:
    """The policy at `path`, or the shipped default when `path` is empty."""
    if not path:
        text, where = default_text()
        return parse(text, where)
    return parse(read_text(path, PolicyError, "healing policy"), str(Path(path)))


def parse(text: str, where: str = "<policy>") -> Policy:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (a NUL, a control)
        at = text.count("\n", 0, e.position) + 1
        raise PolicyError(f"{where}: line {at}: not valid YAML: {e.reason} (#x{e.character:04x})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise PolicyError(f"{where}:{line}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise PolicyError(f"{where}: not valid YAML: nested too deeply") from None
    return _Parser(where).policy(root)


class _Parser:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, node: yaml.Node | None, msg: str) -> PolicyError:
        line = f" line {node.start_mark.line + 1}" if node is not None else ""
        return PolicyError(f"{self.where}:{line}: {msg}")

    def mapping(self, node: yaml.Node | None, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{what}: expected a mapping")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode):
                raise self.fail(k, f"{what}: keys must be plain names")
            if k.value in out:
                raise self.fail(k, f"{what}: duplicate key {k.value!r}")
            out[k.value] = (k, v)
        return out

    def scalar(self, node: yaml.Node, what: str) -> str:
        if not isinstance(node, yaml.ScalarNode) or node.value == "":
            raise self.fail(node, f"{what}: expected a value")
        return node.value

    def names(self, node: yaml.Node, what: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, f"{what}: expected a list, e.g. [a, b]")
        out = []
        for item in node.value:
            v = self.scalar(item, what)
            if allowed is not None and v not in allowed:
                raise self.fail(item, f"{what}: unknown {v!r} (expected one of: {', '.join(allowed)})")
            out.append(v)
        return tuple(out)

    def policy(self, root: yaml.Node | None) -> Policy:
        if root is None:
            raise PolicyError(f"{self.where}: empty healing policy")
        top = self.mapping(root, "policy")
        for key, (k, _) in top.items():
            if key not in ("version", "dedup_window_s", "rules"):
                raise self.fail(k, f"unknown key {key!r} (known: version, dedup_window_s, rules)")
        if "version" not in top or top["version"][1].value != "1":
            raise self.fail(top.get("version", (root, root))[1], "version: expected 1")
        window = 60.0
        if "dedup_window_s" in top:
            node = top["dedup_window_s"][1]
            try:
                window = float(self.scalar(node, "dedup_window_s"))
            except ValueError:
                raise self.fail(node, f"dedup_window_s: expected a number, got {node.value!r}") from None
            if not 0 <= window <= 86400:
                raise self.fail(node, "dedup_window_s: expected a value between 0 and 86400")
        if "rules" not in top:
            raise self.fail(root, "rules: missing")
        rules_node = top["rules"][1]
        if not isinstance(rules_node, yaml.SequenceNode) or not rules_node.value:
            raise self.fail(rules_node, "rules: expected a non-empty list")
        rules, seen = [], set()
        for node in rules_node.value:
            rule = self.rule(node)
            if rule.name in seen:
                raise self.fail(node, f"rule {rule.name!r}: defined twice")
            seen.add(rule.name)
            rules.append(rule)
        return Policy(tuple(rules), window, self.where)

    def rule(self, node: yaml.Node) -> Rule:
        m = self.mapping(node, "rule")
        for key, (k, _) in m.items():
            if key not in _RULE_KEYS:
                raise self.fail(k, f"rule: unknown key {key!r} (known: {', '.join(sorted(_RULE_KEYS))})")
        for req in ("name", "target", "actions"):
            if req not in m:
                raise self.fail(node, f"rule: missing {req!r}")
        name = self.scalar(m["name"][1], "name")
        what = f"rule {name!r}"
        target = self.scalar(m["target"][1], f"{what} target")
        if target not in TARGETS:
            raise self.fail(m["target"][1], f"{what} target: expected one of {', '.join(TARGETS)}, got {target!r}")
        kind = TargetKind(target)
        decide = self.scalar(m["decide"][1], f"{what} decide") if "decide" in m else "agent"
        if decide not in DECIDERS:
            raise self.fail(m["decide"][1], f"{what} decide: expected one of {', '.join(DECIDERS)}, got {decide!r}")
        reasons = (
            self.names(m["reasons"][1], f"{what} reasons", tuple(r.value for r in Reason)) if "reasons" in m else ()
        )
        alerts = self.names(m["alerts"][1], f"{what} alerts") if "alerts" in m else ()
        if not reasons and not alerts:
            raise self.fail(node, f"{what}: needs reasons or alerts to match")
        sev = self.names(m["severities"][1], f"{what} severities", SEVERITIES) if "severities" in m else ()
        labels: dict[str, str] = {}
        if "labels" in m:
            for key, (_, v) in self.mapping(m["labels"][1], f"{what} labels").items():
                labels[key] = self.scalar(v, f"{what} labels.{key}")
        levels = JOB_LEVELS if kind == TargetKind.JOB else MPU_LEVELS
        acts: dict[str, tuple[str, ...]] = {}
        for key, (k, v) in self.mapping(m["actions"][1], f"{what} actions").items():
            if key != "any" and key not in levels:
                raise self.fail(
                    k, f"{what} actions: unknown level {key!r} (expected any or one of: {', '.join(levels)})"
                )
            acts[key] = self.names(v, f"{what} actions.{key}", actions.NAMES)
        return Rule(
            name=name,
            decide=decide,
            target=kind,
            reasons=frozenset(reasons),
            alerts=frozenset(alerts),
            severities=frozenset(sev),
            labels=labels,
            actions=acts,
        )
