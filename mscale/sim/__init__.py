"""SIMULATION: simulated GPUs behind the NVML interface, fault timelines, the corruption
injector, the tiny multimodal model and chaos (its CLI and its job-side plugin).

Runs wherever the simulated node does: in the agent (`--simulate`), in a training job (the
injector, the chaos plugin) and in the demo. May import: link, agent_client, textfile,
probes.nvml_api, probes.gpu_health (the interface the simulated GPUs implement, the health they
report). Never imports daemon.
"""
