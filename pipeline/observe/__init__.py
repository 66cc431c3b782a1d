"""Reading runs back: the trace reader, the run view, replay and Perfetto timelines."""
