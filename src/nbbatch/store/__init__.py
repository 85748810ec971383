"""Store: the share (a folder, Azure Files) and everything in it: the layout of paths, run records,
cancel markers, the driver's lock, fetching results; and which experiments this project submitted."""
