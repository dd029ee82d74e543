"""What every backend shares: submission checks and row matching (``matching``), registered
regions (``regions``), transfer ids and used-hint accounting (``transfers``), the attempt a
progress thread concludes (``attempt``), and the engine that holds them together
(``engine``): the contract's calls, revocation, passive waits' conclusions, the progress
thread and shutdown's first step."""
