"""Cleaning stages: each looks at one document and keeps it (maybe edited) or drops it
with a named reason. `lathe.data.pipeline` composes them in a fixed order from a recipe."""
