"""Resource contracts: what a training step declares it needs of the host, checked before the
first step and turned into an execution plan (CPU masks per named I/O thread, GPU binding,
hugepage pools, RDMA ports, NVMe namespaces, recovery point).

Run by three processes: the TRAINING JOB (`mscale.contract(...)`: hardware view, validation,
pinning its own threads and data-loader workers), the CLI (`mscale contract check|status`,
mscale.daemon.contract.cli: it reads the agent's [contract] section) and the AGENT (the plan's
types, read back from the link, and the profile catalogue; its side is mscale.daemon.contract).

May import: options (the config machinery), textfile, link. Outside the package: the standard
library and PyYAML. Never imports torch, daemon or hook, so the agent and the CLI load it in
milliseconds.

  hardware  the host from /sys and /proc behind injectable roots (HostView)
  spec      the contract's fields, its stable error codes (Code), the profile catalogue
  validate  contract + host -> Plan, or ContractRefused with every problem
  plan      the execution plan, plain data that travels over the link
  pin       CPU affinity and task names inside the job
  declare   mscale.contract(...): decorator and call form
  settings  the [contract] config section
"""

from __future__ import annotations

from mscale.contracts.spec import Code, Contract, ContractRefused, Problem

__all__ = ["Code", "Contract", "ContractRefused", "Problem"]
