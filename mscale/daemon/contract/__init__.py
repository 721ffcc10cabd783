"""The agent's side of resource contracts and MSRP: the service that checks each job's process
against its contract and keeps the density guard (service.py), their metrics (exporter.py,
msrp_exporter.py) and the `mscale contract` command, which reads the agent's config
(cli.py). The contract's own model, the host view and the validation are torch-free and
shared with the job (mscale.contracts); the link carries them (mscale.link.contract).
"""
