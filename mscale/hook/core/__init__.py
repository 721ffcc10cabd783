"""The hook library's core: the Guard and its step (guard, scaler, commit, agree), the MPUs and
the model families' layouts (mpu, families), the plugin surface (plugin), one-line attach and
protection (attach, protect), the step report and the agent link client (report, link), and the
plugins that carry the job's facts to the agent (goodput, contract, msrp)."""
