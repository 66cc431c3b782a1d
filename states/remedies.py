"""Remedies that are true: what to change so that a refused start resolves, tried rather than guessed.

Resolve's refusals offer the backends its survey finds able to serve the request, each completed by
:func:`complete_fix`; an unknown name gets the closest known one (:func:`suggest`). Refusals carry their fixes as data
(``err.fixes``; a :class:`StrictRefusal`'s ``avoid``). Pure decisions, no torch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import msgspec

from pipeline.backends import packages, registry
from pipeline.core.contracts import AttentionArgs, DeviceFacts, ModelSpec
from pipeline.core.errors import ConfigError
from pipeline.core.validation import nearest_name
from states.capability_check import Reason, reasons_with_flags
from states.fallback import StrictRefusal, assignments, one_of

# decide(args, model, device, *, is_draft_worker, installed) for a trial (raises the refusal, never tries remedies)
ProbeDecide = Callable[..., Any]


def fixes_of(err: ConfigError) -> list[dict[str, Any]]:
    """The field changes a resolve refusal proposes, as data (a strict refusal's ``avoid``, else ``err.fixes``)."""
    if isinstance(err, StrictRefusal):
        return [err.avoid]
    return list(getattr(err, "fixes", []))


def complete_fix(decide: ProbeDecide, args: AttentionArgs, model: ModelSpec, device: DeviceFacts,
                 installed: Mapping[str, bool], is_draft_worker: bool,
                 fix: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``(fix, resolved)``: ``fix`` extended, through ``decide`` as a probe, with each agreeing fix the next refusal
    carries until the request resolves; ``resolved`` False (best ``fix`` so far) when a refusal without a fix remains.
    """
    for _ in range(8):
        try:
            decide(msgspec.structs.replace(args, **fix), model, device, is_draft_worker=is_draft_worker,
                   installed=installed)
        except ConfigError as e:
            nxt = next((f for f in fixes_of(e) if any(k not in fix for k in f)
                        and all(fix.get(k, v) == v for k, v in f.items())), None)
            if nxt is None:
                return fix, False
            fix = {**fix, **nxt}
            continue
        return fix, True
    return fix, False


def minimal(fixes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fixes that contain no other fix of the list, each once and in order (a remedy says each way once:
    PD-mux + TBO on a CPU resolves by dropping PD-mux alone, so "drop both" is not offered beside it)."""
    out: list[dict[str, Any]] = []
    for f in fixes:
        if f not in out and not any(g != f and g.items() <= f.items() for g in fixes):
            out.append(f)
    return out


class Survey:
    """Every registered backend's reasons for one request: who works, who would if installed (a package missing, or
    installed at a version attn-setup does not support)."""

    def __init__(self, **ctx) -> None:
        self.why: dict[str, list[Reason]] = {
            n: reasons_with_flags(registry.get(n).capability, **ctx) for n in registry.names()}
        self.working = [n for n, r in self.why.items() if not r]
        self.installable = [n for n, r in self.why.items() if r and all(x.is_package for x in r)]
        self.unsupported = sorted({x.flags[0][1] for r in self.why.values() for x in r if x.is_version})

    def install_words(self, pk: Sequence[str]) -> str:
        """``a and b`` for a remedy's "install …": a package installed at an unsupported version is named with the
        supported ones (``flashinfer-python==0.7.2``)."""
        return " and ".join(packages.requirement(p) if p in self.unsupported else p for p in pk)

    def missing_note(self) -> str:
        """One sentence naming the backends that would work if their package were installed (at a supported
        version)."""
        pk = sorted({x.flags[0][1] for n in self.installable for x in self.why[n]})
        head = f"no installed backend can serve this; only {', '.join(self.installable)} could"
        if not any(p in self.unsupported for p in pk):
            return (f"{head}, and it needs package(s) {', '.join(pk)}, which {'is' if len(pk) == 1 else 'are'} not "
                    "installed")
        return f"{head}, and it needs {', '.join(packages.requirement(p) for p in pk)}, not installed here"

    def field_fixes(self) -> list[dict[str, Any]]:
        """Each backend's reason fixes together, for the backends whose every reason has one (not tried)."""
        return minimal([{k: v for r in why for k, v in r.fix} for why in self.why.values()
                        if why and all(r.fix for r in why)])

    @staticmethod
    def versions_only(why: Sequence[Reason]) -> bool:
        """Whether ``why`` (one backend's reasons) names packages only, one of them at an unsupported version: the
        backend serves once the supported versions are installed (``package_version_unsupported``)."""
        return bool(why) and all(r.is_package for r in why) and any(r.is_version for r in why)

    @staticmethod
    def pip_command(why: Sequence[Reason]) -> str:
        """The pip commands that install the supported versions of the packages ``why`` names."""
        return "; ".join(packages.install_hint(p) for p in sorted({r.flags[0][1] for r in why if r.is_package}))

    def packages_of(self, name: str) -> list[str]:
        """The packages whose absence (or unsupported version) is (part of) why ``name`` cannot serve."""
        return sorted({x.flags[0][1] for x in self.why.get(name, []) if x.is_package})

    def remedy_without_working(self) -> str:
        if self.installable:
            pk = sorted({x.flags[0][1] for n in self.installable for x in self.why[n]})
            return f"install {self.install_words(pk)} (see the reasons), or change the model/dtype/flags"
        return "no registered backend can serve this; change the model, dtype or flags named in the reasons"


class Remedies:
    """The remedies of one resolve request: ``survey`` (:class:`Survey`), ``decide`` (resolve's, as a probe), ``probe``
    (this request is itself a trial: remedies are not tried)."""

    def __init__(self, decide: ProbeDecide, args: AttentionArgs, model: ModelSpec, device: DeviceFacts,
                 installed: Mapping[str, bool], is_draft_worker: bool, survey: "Survey", probe: bool) -> None:
        self.decide, self.args, self.model, self.device, self.installed = decide, args, model, device, installed
        self.is_draft_worker, self.survey, self.probe = is_draft_worker, survey, probe

    def complete(self, fix: dict[str, Any], packages: Sequence[str] = ()) -> dict[str, Any]:
        """``fix`` with what the rest of the request needs to resolve (:func:`complete_fix`), as far as it goes;
        ``packages`` are assumed installed. A probe (a trial inside another remedy) returns ``fix`` as is."""
        if self.probe:
            return dict(fix)
        installed = {**self.installed, **{p: True for p in packages}}
        return complete_fix(self.decide, self.args, self.model, self.device, installed, self.is_draft_worker,
                            dict(fix))[0]

    def options(self, flag: str, names: Sequence[str]) -> tuple[list[str], list[dict[str, Any]]]:
        """Setting ``flag`` to each of ``names`` (backends that can serve it): (names that suffice alone,
        fixes that also need other fields — strict's, or a second fault's — tried, not guessed)."""
        alone, more = [], []
        for n in names:
            fix = self.complete({flag: n})
            (alone if len(fix) == 1 else more).append(fix)
        return [f[flag] for f in alone], more

    def set_remedy(self, flag: str, names: Sequence[str], first: Optional[str] = None) -> tuple[list[str], str]:
        """(allowed, remedy) offering ``names`` for ``flag`` with what each needs; ``first`` leading."""
        alone, more = self.options(flag, names)
        if first in alone:
            alone = [first] + [n for n in alone if n != first]
        parts = [f"set {flag} to one of: {one_of(alone)}"] if alone else []
        parts += [assignments(f) for f in more]
        return alone, (", or ".join(parts) if parts else self.install_for(flag))

    def install_for(self, flag: str) -> str:
        """The remedy when nothing installed can take ``flag``: install what a backend needs and set ``flag``
        to it (with what else the request needs), else :meth:`without_working`."""
        survey, parts = self.survey, []
        for name in survey.installable:
            pk = survey.packages_of(name)
            parts.append(f"install {survey.install_words(pk)} and {assignments(self.complete({flag: name}, pk))}")
        return ", or ".join(parts) if parts else self.without_working()

    def flag_fixes(self) -> list[dict[str, Any]]:
        """Field changes that make an installed backend serve the request: each backend whose every reason carries a fix
        (:attr:`states.capability_check.Reason.fix`), completed (:func:`complete_fix`) and kept when it resolves;
        registry order, none contained in another; none for a probe."""
        if self.probe:
            return []
        out = []
        for fix in self.survey.field_fixes():
            fix, ok = complete_fix(self.decide, self.args, self.model, self.device, self.installed,
                                   self.is_draft_worker, fix)
            if ok:
                out.append(fix)
        return minimal(out)

    def without_working(self) -> str:
        """The remedy when no installed backend resolves and no flag names one: the field changes that make one
        serve it (:meth:`flag_fixes`), then installing what would serve it (with what else the request then
        needs), or else changing the request."""
        survey, parts = self.survey, [assignments(f) for f in self.flag_fixes()]
        if survey.installable:
            pk = sorted({p for n in survey.installable for p in survey.packages_of(n)})
            fix = self.complete({}, pk)
            then = f" and {assignments(fix)}" if fix else ""
            parts.append(f"install {survey.install_words(pk)}{then} (see the reasons)")
        if not parts:
            return survey.remedy_without_working()
        return " or ".join(parts) + ("" if len(parts) > 1 or not survey.installable
                                     else ", or change the model/dtype/flags")


def suggest(name: str, ctx: Remedies) -> tuple[Optional[str], str]:
    """(closest known backend name, one sentence) for an unknown ``name``: registered or sglang's, case-insensitive,
    difflib ratio >= 0.6."""
    best = nearest_name(name, registry.known_names())
    if best is None:
        return None, ""
    note = f"did you mean {best!r}?"
    if best in registry.KNOWN_UNAVAILABLE:
        return best, f"{note} (sglang's {registry.KNOWN_UNAVAILABLE[best]}, which attn-setup does not implement)"
    why = ctx.survey.why[best]
    if not why:
        return best, note
    pk = ctx.survey.packages_of(best)
    if pk and best in ctx.survey.installable:
        hints = sorted({packages.install_hint(p) for p in pk})
        what = "not installed at a supported version" if set(pk) & set(ctx.survey.unsupported) else "not installed"
        return best, f"{note} It needs {one_of(pk)}, which is {what} ({'; '.join(hints)})"
    return best, f"{note} It cannot serve this request here: {'; '.join(r.text for r in why)}"
