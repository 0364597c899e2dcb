"""Planning: predict memory and step time of a configuration before it runs."""
