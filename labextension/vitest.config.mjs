import { defineConfig } from 'vitest/config';

// Unit tests run in jsdom: no browser download; the real-browser test is tests/browser/.
export default defineConfig({
  test: {
    environment: 'jsdom',
    include: ['test/**/*.test.ts'],
    setupFiles: ['test/setup.ts']
  }
});
