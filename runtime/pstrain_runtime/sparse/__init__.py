"""Sparse embedding tables whose rows live on the parameter servers (see docs/sparse.md).

    from pstrain_runtime.sparse import SparseEmbedding, SparseEmbeddingBag
"""

from .ids import initial_rows, owner_of, stream_of
from .collection import SparseEmbeddingCollection
from .layer import SparseEmbedding, SparseEmbeddingBag, apply_sparse_gradients, sparse_layers
from .spec import TableSpec

__all__ = ["SparseEmbedding", "SparseEmbeddingBag", "SparseEmbeddingCollection", "TableSpec", "apply_sparse_gradients",
           "initial_rows", "owner_of", "sparse_layers", "stream_of"]
