"""Predictions on paper, no run needed: bytes per tier (memory.py), the step model (stepmodel.py, its configuration
step_config.py, its reading prediction.py, its list scheduler schedule.py), and the costs of activation policies
(activation_cost.py), of the hybrid split (hybrid_split.py), of streaming (streaming_cost.py) and of ranks
(shards.py, scaling.py); and the step model's conditions for each transfer to hide under compute (hiding.py).

What this is not: a measurement. The figures of a machine come from machine/.
"""
