"""The engine's one execution plan (execution.py), built at start-up by planner.py and handed down."""

from decodeservice.engine.plan.execution import (
    AttentionPlan,
    CpuAttentionPlan,
    CudaAttentionPlan,
    ExecutionPlan,
    KvPlan,
    SpeculationPlan,
    StepPlan,
)

__all__ = ["AttentionPlan", "CpuAttentionPlan", "CudaAttentionPlan", "ExecutionPlan", "KvPlan", "SpeculationPlan",
           "StepPlan"]
