"""benchmarks/flow_profile.py captures the network a real split's cut solves and times
networkx's maximum-flow functions on it: every one leaves dinitz's sink side."""

from __future__ import annotations

import json

from benchmarks.flow_profile import FUNCTIONS, flow_profile, main


def test_every_flow_function_gives_the_same_sink_side_on_a_captured_network():
    row = flow_profile(200, repeat=1)
    assert row["network_edges"] > 0 and row["network_nodes"] > 2
    assert row["same_sink_side"] == dict.fromkeys(FUNCTIONS, True)
    assert all(len(row["cpu_s"][name]) == 1 for name in FUNCTIONS)


def test_the_command_prints_one_json_line(capsys):
    assert main(["--nodes", "200", "--repeat", "1", "--functions", "dinitz"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert set(row["cpu_s"]) == {"dinitz"}
