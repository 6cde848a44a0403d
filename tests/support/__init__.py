"""What the tests share: the real host sources, stand-ins for what a CPU host lacks, the
independent references and the CPU harnesses. Never imported by the product."""
