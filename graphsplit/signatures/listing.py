"""The shape signatures of a split, as the report, ``plan.json`` and the picture list them.

A split whose plans hold no size check (every size flows through torch ops) lists nothing: its
report is what it always was. Otherwise each plan made so far is one entry: its key (what a
cache records per row), whether it is the first plan, and each checked value with the user's
line that read it. Nothing timed: the same plans list the same (plan.json is compared).

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
        lines.append(f"  {entry['key']}" + (" (the first plan)" if entry["first"] else ""))
        for check in entry["checks"]:
            lines.append(f"    {check['what']} = {check['expected']}  {check['source'] or ''}")
    return lines


def signatures_html(split: Any) -> str:
    """The picture page's section listing the signatures ("" when there is nothing to list)."""
    entries = signature_entries(split)
    if not entries:
        return ""
    rows = []
    for entry in entries:
        for check in entry["checks"]:
            rows.append(
                "<tr>"
                + "".join(
                    f"<td>{html.escape(str(cell))}</td>"
                    for cell in (
                        entry["key"] + (" (first)" if entry["first"] else ""),
                        check["what"],
                        check["expected"],
                        check["source"] or "",
                    )
                )
                + "</tr>"
            )
    return (
        "<h2>Shape signatures</h2>\n<p>One plan per signature; a batch whose checked values "
        "differ gets a plan of its own.</p>\n<table><tr><th>plan</th><th>checked value</th>"
        "<th>expected</th><th>line</th></tr>\n" + "\n".join(rows) + "\n</table>"
    )
