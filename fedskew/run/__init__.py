"""Running fedskew: the launcher (a run on a private SuperLink), the warm executor and its actor
pool, Ray clusters, and experiment suites."""
