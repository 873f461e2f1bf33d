"""MiniMax-H3 as diffusers implements it: tiny repositories of the real classes, plan pages and the
modules that read them in place of `adaln_proj` / `norm_out.linear`."""
