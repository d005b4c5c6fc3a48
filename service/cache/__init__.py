"""The embedding cache: entries addressed by an image's content and the model that embedded it (``entries``),
kept in a worker's memory and a store shared by workers (``stores``: sqlite on disk, ``redis_store``: Redis
for a fleet), tiered by ``tiers``. Nothing here knows of HTTP, the pipeline or torch."""
