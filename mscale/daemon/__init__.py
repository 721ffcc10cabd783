"""AGENT process (`mscale agent`): service loop, HTTP API, webhook, Unix-socket link server,
job state, the agent's healing service, its Prometheus collectors (exporters/), systemd notify.

May import: findings, options, logs,
link, agent_client, healing (the decision core), probes, kube, sim (the simulated
node of `--simulate`), contracts (torch-free), tasks, textfile. Never imports torch, and nothing job-side (hook,
snapshot) imports this package.
"""
