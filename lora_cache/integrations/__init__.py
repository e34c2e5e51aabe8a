"""Integrations with serving frameworks (floor 7, beside ``lora_cache.app``): each imports the client and the
engine seam; nothing in lora-cache imports them. ``ray_serve``: a Ray Serve request router and replica helper."""
