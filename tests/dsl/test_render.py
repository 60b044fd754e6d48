from __future__ import annotations

import networkx as nx

from flowkit.dsl import Flow
from flowkit.dsl.render import summary
from tests.dsl.shapes import grpo_step, step
from tests.harness import printed


def test_summary_shows_ops_ports_types_granularity_models_and_barriers(actor):
    text = printed(summary(grpo_step(actor)), width=100)
    assert "flow 'grpo': 5 ops, 4 wires" in text
    assert "generate  generate on actor  n=4" in text
    assert "in  group: Grouped[Scored] <- group_by(prompt_id, size=4)(score.out)" in text
    assert "in  batch: Batch[Scored] <- collect(advantages.out)" in text
    assert "pkg.models:build_gpt" in text
    assert "barrier: waits for every item" in text


def test_to_dot_is_a_parseable_digraph_with_barrier_and_feedback_edges(actor):
    flow = grpo_step(actor)
    dot = flow.to_dot()
    assert dot.startswith('digraph "grpo" {') and dot.rstrip().endswith("}")
    for node in flow.nodes:
        assert f'"{node}" [label=' in dot
    assert '"advantages" -> "train"' in dot and 'color="#c0392b"' in dot
    assert "Grouped[Scored]" in dot and "group_by(prompt_id, size=4)" in dot
    # Every edge line names two declared nodes: the DOT describes exactly the flow's graph.
    edges = {tuple(part.strip().strip('"') for part in line.split("[")[0].split("->"))
             for line in dot.splitlines() if "->" in line and "[label=" in line}
    assert edges == set(flow.graph.edges)


def test_feedback_edges_are_dashed_and_do_not_constrain_layout():
    with Flow("loop") as flow:
        carried = flow.feedback("state", float)
        carried.bind(step(carried))
    dot = flow.to_dot()
    assert "style=dashed" in dot and "constraint=false" in dot and "(next step)" in dot
    assert nx.is_directed_acyclic_graph(nx.DiGraph([(w.src, w.dst) for w in flow.wires
                                                    if not w.feedback]))
