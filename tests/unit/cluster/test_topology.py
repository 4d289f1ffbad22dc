"""plan_groups: task groups + ratios -> contiguous device ranges (no Ray)."""
import pytest

from megarl.cluster.topology import GroupPlan, TopologyError, normalize_groups, plan_groups

ALL4 = ["generate", "ref_logp", "logp", "actor-train"]


def test_normalize_bare_names_to_one_task_groups():
    assert normalize_groups([["logp", "actor-train"], "generate"]) == [
        ("logp", "actor-train"), ("generate",)]


def test_one_node_two_groups():
    plans = plan_groups([["logp", "actor-train", "ref_logp"], ["generate"]], [0.5, 0.5], 1, 2)
    assert [p.name for p in plans] == ["logp+actor-train+ref_logp", "generate"]
    assert [p.devices for p in plans] == [(0,), (1,)]
    assert [p.nodes for p in plans] == [(0,), (0,)]
    assert plans[1].tasks == ("generate",) and plans[1].num_devices == 1


def test_one_node_colocated_default():
    (plan,) = plan_groups([ALL4], [1.0], 1, 8)
    assert plan.devices == tuple(range(8)) and plan.device_range == range(8)
    assert plan.nodes == (0,)


def test_four_nodes_design_example():
    plans = plan_groups([["logp", "actor-train"], "ref_logp", "generate"],
                        [0.5, 0.25, 0.25], nnodes=4, devices_per_node=8)
    assert [p.name for p in plans] == ["logp+actor-train", "ref_logp", "generate"]
    assert [p.num_devices for p in plans] == [16, 8, 8]
    assert plans[0].device_range == range(0, 16) and plans[0].nodes == (0, 1)
    assert plans[1].device_range == range(16, 24) and plans[1].nodes == (2,)
    assert plans[2].device_range == range(24, 32) and plans[2].nodes == (3,)


def test_plans_are_frozen():
    (plan,) = plan_groups([ALL4], [1.0], 1, 1)
    assert isinstance(plan, GroupPlan)
    with pytest.raises(AttributeError):
        plan.name = "x"


def test_ratios_with_float_noise_still_whole():
    plans = plan_groups([["logp", "actor-train", "ref_logp"], "generate"], [0.7, 0.3], 10, 1)
    assert [p.num_devices for p in plans] == [7, 3]


@pytest.mark.parametrize("tasks,ratios,nnodes,per_node,field,needle", [
    ([ALL4], [0.5, 0.5], 1, 2, "ratios", "2 ratios for 1"),
    ([ALL4, "reward"], [1.0, 0.0], 1, 2, "ratios", "> 0"),
    ([ALL4], [0.9], 1, 2, "ratios", "sum"),
    ([["logp", "actor-train", "ref_logp"], "generate"], [0.5, 0.5], 1, 3, "ratios",
     "whole number of devices"),
    ([["logp", "actor-train"], "ref_logp", "generate"], [0.5, 0.25, 0.25], 2, 8, "ratios",
     "whole number of nodes"),
    ([["logp", "actor-train"], "generate"], [0.5, 0.5], 1, 2, "tasks", "ref_logp"),
    ([ALL4, ["logp"]], [0.5, 0.5], 1, 2, "tasks", "'logp'"),
    ([ALL4 + ["critic_model"]], [1.0], 1, 2, "tasks", "did you mean `critic`"),
    ([ALL4 + ["critic"], ["critic"]], [0.5, 0.5], 1, 2, "tasks", "'critic' appears"),
    ([ALL4, []], [0.5, 0.5], 1, 2, "tasks", "empty"),
])
def test_bad_layouts(tasks, ratios, nnodes, per_node, field, needle):
    with pytest.raises(TopologyError) as err:
        plan_groups(tasks, ratios, nnodes, per_node)
    assert err.value.field == field and needle in str(err.value)
