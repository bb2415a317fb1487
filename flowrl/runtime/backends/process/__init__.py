"""The ``process`` backend: one OS process per executor, forked from a zygote."""
