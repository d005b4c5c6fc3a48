"""One-question A/B probes: each answered one change's before/after (``--root`` an earlier checkout's worktree,
then this one) and is kept to answer it again. The current figures per topic come from the benchmarks one level
up (docs/BENCHMARKS.md); what these measured is in docs/history/."""
