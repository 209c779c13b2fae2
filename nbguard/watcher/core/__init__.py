"""The watch core: its state and record, the step state machine, attach/detach, construction; the component
protocol and its board, the context components use, the component registry and ``WatchConfig``, the one guard."""
