"""SIMULATION: simulated GPUs behind the NVML interface, fault timelines, the corruption
injector, the tiny multimodal model and chaos (its CLI and its job-side plugin).

Runs wherever the simulated node does: in the agent (`--simulate`), in a training job (the
injector, the chaos plugin) and in the demo. May import: findings, probes.nvml_api, hook.
"""
