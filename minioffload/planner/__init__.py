"""Choosing a run: every configuration checked against the machine and ranked by the step model (search.py), its
exact part (milp.py), what a plan is (plan.py), reading the results (report.py), a pre-flight check of a machine
(doctor.py), and the plan in DeepSpeed's, FSDP2's and torchao's terms (export.py, export_code.py).

What this is not: a runner. `train --plan` runs a plan (train/).
"""
