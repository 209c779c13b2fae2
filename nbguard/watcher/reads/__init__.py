"""What the watch reads on the device each step, in one host read: gradient norms, clip taps, activation
abs-max, and the history and rolling statistics kept of them."""
