"""A run's machinery: the process group and its watchdog (parallel, watchdog), the policy on 1..N processes
(policy), checkpoints (checkpoint), the run folder and the settings it records (rundir), logs and plots (runlog),
a training run's set-up (startup) and the embedded model's supervised cold start (coldstart)."""
