"""What the watch does about a bad step: the policies (warn, skip, stop) and policy rewind."""
