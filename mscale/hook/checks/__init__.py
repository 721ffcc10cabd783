"""The hook library's checks: tensor checksums (ABFT on linears, replays, output statistics),
the batch, gradient and weight checks, loss and gradient-norm statistics, CMSA, and the budget
and coverage that size them."""
