-- The example database of examples/sql-adapter.yaml; shop.db was made from it (`sqlite3 shop.db < shop.sql`).
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT, joined TEXT);
CREATE TABLE products (id INTEGER PRIMARY KEY, title TEXT NOT NULL, price REAL);
CREATE TABLE orders (
  id INTEGER PRIMARY KEY,
  customer_id INTEGER NOT NULL REFERENCES customers(id),
  product_id INTEGER NOT NULL REFERENCES products(id),
  qty INTEGER NOT NULL,
  total REAL NOT NULL,
  day TEXT NOT NULL
);
CREATE INDEX orders_customer ON orders (customer_id);
INSERT INTO customers VALUES (1, 'Ada', 'Oslo', '2025-03-01'), (2, 'Bob', 'Bergen', '2025-06-12'),
  (3, 'Cy', 'Oslo', '2025-09-30'), (4, 'Dee', 'Lyon', '2026-01-15');
INSERT INTO products VALUES (1, 'Anvil', 99.9), (2, 'Bolt', 0.25), (3, 'Cog', 3.0);
INSERT INTO orders VALUES (1, 1, 1, 1, 99.9, '2026-01-02'), (2, 1, 2, 40, 10.0, '2026-01-05'),
  (3, 2, 3, 5, 15.0, '2026-02-11'), (4, 3, 2, 100, 25.0, '2026-03-01'), (5, 4, 1, 2, 199.8, '2026-03-09'),
  (6, 4, 3, 1, 3.0, '2026-04-20');
