"""The shape signatures of a split, as the report, ``plan.json`` and the picture list them.

A split whose plans hold no size check (every size flows through torch ops) lists nothing: its
report is what it always was. Otherwise each plan made so far is one entry: its key (what a
cache records per row), whether it is the first plan, its short name
(:mod:`~graphsplit.signatures.names`: the checks that tell the plans apart) and, in plan.json,
each checked value with the user's line that read it. The report and the picture show the
short names and the lines of the checks that vary; a check every plan holds alike is counted,
not repeated. Nothing timed: the same plans list the same (plan.json is compared).

In and out::

    signature_entries(split) -> list[dict]   # JSON-ready, one per plan, the first first
    signature_lines(split) -> list[str]      # the report's section ([] when nothing to list)
    signatures_html(split) -> str            # the picture page's section ("" likewise)
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["signature_entries", "signature_lines", "signatures_html"]


def _plans(split: Any) -> list[Any]:
    plan_set = getattr(split, "plan_set", None)
    if plan_set is None:
        return []
    plans = list(plan_set.plans.values())
    if len(plans) == 1 and not plans[0].signature.values:
        return []
    return plans


def signature_entries(split: Any) -> list[dict[str, Any]]:
    """One entry per plan (see the module docstring); [] for a split without size checks."""
    entries = []
    for index, plan in enumerate(_plans(split)):
        lines = dict(plan.signature.lines)
        entries.append(
            {
                "key": plan.key,
                "first": index == 0,
                "name": split.plan_set.name(plan),
                "reads_values": plan.signature.reads_values,
                "checks": [
                    {"what": what, "expected": value, "source": lines.get(what)}
                    for what, value in plan.signature.as_dict().items()
                ],
            }
        )
    return entries


def signature_lines(split: Any) -> list[str]:
    """The report's "Shape signatures" section: [] when there is nothing to list."""
    entries = signature_entries(split)
    if not entries:
        return []
    plan_set = split.plan_set
    lines = [
        "",
        f"Shape signatures ({len(entries)} plan(s) of max_plans={plan_set.max_plans}; a batch "
        "whose checked values differ gets a plan of its own):",
    ]
    for entry in entries:
        first = " (the first plan)" if entry["first"] else ""
        lines.append(f"  {entry['key']}{first}: {entry['name']}")
    varying, alike = _checks_listed(split, entries)
    if varying:
        lines.append("  checked values that differ between the plans, read at:")
        lines += [f"    {what}  {source}" for what, source in varying.items()]
    if alike:
        lines.append(
            f"  {alike} other checked value(s), the same in every plan: listed in plan.json "
            '("signatures")'
        )
    return lines


def _checks_listed(split: Any, entries: list[dict[str, Any]]) -> tuple[dict[str, str], int]:
    """The checks whose values differ between the plans (each with its line; with one plan,
    every check), and how many others every plan holds alike."""
    every = {check["what"]: check["source"] or "" for e in entries for check in e["checks"]}
    varying = split.plan_set.varying() if len(entries) > 1 else {}
    shown = {what: every.get(what, source) for what, source in varying.items()} or every
    return shown, len(every) - len(shown)


def signatures_html(split: Any) -> str:
    """The picture page's section listing the signatures ("" when there is nothing to list)."""
    entries = signature_entries(split)
    if not entries:
        return ""
    rows = [
        f"<tr><td>{html.escape(entry['key'] + (' (first)' if entry['first'] else ''))}</td>"
        f"<td>{html.escape(entry['name'])}</td></tr>"
        for entry in entries
    ]
    varying, alike = _checks_listed(split, entries)
    checks = "".join(
        f"<li><code>{html.escape(what)}</code> {html.escape(source)}</li>"
        for what, source in varying.items()
    )
    return (
        "<h2>Shape signatures</h2>\n<p>One plan per signature; a batch whose checked values "
        "differ gets a plan of its own.</p>\n<table><tr><th>plan</th><th>signature</th></tr>\n"
        + "\n".join(rows)
        + f"\n</table>\n<p>Checked values that tell the plans apart, read at:</p><ul>{checks}"
        f"</ul><p>{alike} other checked value(s), the same in every plan (plan.json).</p>"
    )
