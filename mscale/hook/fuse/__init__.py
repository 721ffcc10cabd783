"""The hook library's fuse: the three-level fuse plugin (fuse), the healing actions' executors
(actions/), and what the levels do to a model: placement (L1), degrade (L2), distil (L3), and
the standby device the node agrees on."""
