"""AGENT process (`mscale agent`): service loop, HTTP API, webhook, Unix-socket link server,
job state, the agent's healing service, systemd notify.

May import: findings, config (the agent's, assembled from the rooms' sections), options, link,
healing (the decision core), probes, exporters, rules, contracts (torch-free).
Never imports torch, and nothing job-side (hook, snapshot) imports this package.
"""
