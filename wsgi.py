from service.app import create_app
from service.balance.gunicorn_worker import worker_balance

app = create_app(balance=worker_balance())
