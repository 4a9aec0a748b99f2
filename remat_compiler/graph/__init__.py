"""The graph layer: the annotated joint graph as a networkx cost graph, and its repeated blocks."""
from remat_compiler.graph.blocks import (BlockStack, block_boundary_set, block_classes, block_stack,
                                         identical_blocks, representative_block)
from remat_compiler.graph.costgraph import CostGraph

__all__ = ["CostGraph", "BlockStack", "identical_blocks", "block_stack", "block_classes",
           "block_boundary_set", "representative_block"]
