"""greenserve: image embeddings and classification, Flask behind gunicorn -k gevent."""
