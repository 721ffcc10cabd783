"""TRAINING JOB: snapshots of the whole training state and their restore.

The on-disk format module reads, lists and verifies snapshots without torch (the
`mscale snapshot` CLI uses only it); the engine, the Guard plugin and the data-position
adapters run inside the training process.

May import: findings, config, healing, hook. Never imports daemon.
"""
