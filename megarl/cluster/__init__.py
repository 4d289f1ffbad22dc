"""Cluster layout: pure task-group planning (topology) and, later, Ray placement."""
from megarl.cluster.topology import GroupPlan, TopologyError, normalize_groups, plan_groups

__all__ = ["GroupPlan", "TopologyError", "normalize_groups", "plan_groups"]
