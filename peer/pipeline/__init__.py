"""Pipeline stages: a model split across peers (issue #19; DiLoCoX arXiv 2506.21263, SWARM arXiv 2301.11913)."""
