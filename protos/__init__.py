"""protos: .proto sources and the Python code generated from them."""
