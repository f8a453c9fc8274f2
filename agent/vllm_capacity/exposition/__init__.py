"""What the agent exports: the catalogue of every metric (:mod:`.catalogue`) and the render of a snapshot as
Prometheus metrics (:mod:`.render`)."""
