"""``lightning-accel tune``: measure the levers on a job, keep what pays, guard the run (a composer like the CLI)."""
