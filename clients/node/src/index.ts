// The Node.js client of the kvmesh indexer, built from the generated
// TypeScript stubs in src/gen/ (protobuf-es v2, from proto/ by
// proto/buf.gen.node.yaml): typed requests and responses over @grpc/grpc-js,
// the block keys of docs/spec/block-keys.md, and the standard error details.

import * as grpc from '@grpc/grpc-js';
import { IndexerService } from './gen/kvmesh/indexer/v1/indexer_pb';
import { serviceClient, type CallOptions, type ServiceClient } from './client';
import type { ConnectionOptions } from './connection';
import type { MessageInitShape } from '@bufbuild/protobuf';
import type { BatchAck, EventBatchSchema, PublishEventsStreamResponse } from './gen/kvmesh/indexer/v1/indexer_pb';

export { grpc };
export * from './gen/kvmesh/indexer/v1/indexer_pb';
export * from './blockkeys';
export * from './client';
export * from './connection';
export * from './status';

/** Trailing metadata key naming the offending field of an INVALID_ARGUMENT. */
export const ERROR_FIELD_METADATA = 'kvmesh-error-field';

/** A client of the kvmesh indexer (IndexerService). */
export type IndexerClient = ServiceClient<typeof IndexerService>;

/**
 * An IndexerService client for `address`: host:port, `dns:///name:port`, or
 * several replica addresses (see `channelTarget`); `options` as for `connection`.
 */
export function indexerClient(address: string | readonly string[], options: ConnectionOptions = {}): IndexerClient {
  return serviceClient(IndexerService, address, options);
}

/**
 * Publish batches over PublishEventsStream, in order, and resolve with one
 * ack per batch (a rejected batch is reported in its ack; the stream goes on).
 */
export function publishStream(
  client: IndexerClient,
  batches: readonly MessageInitShape<typeof EventBatchSchema>[],
  options: CallOptions = { deadlineMs: 10000 },
): Promise<BatchAck[]> {
  return new Promise((resolve, reject) => {
    const acks: BatchAck[] = [];
    const call = client.publishEventsStream(options);
    call.on('data', (res: PublishEventsStreamResponse) => {
      if (res.ack) acks.push(res.ack);
    });
    call.on('error', reject);
    call.on('end', () => resolve(acks));
    for (const batch of batches) call.write({ batch });
    call.end();
  });
}

/** The field an error names (trailing metadata), or '' when it names none. */
export function errorField(err: Partial<Pick<grpc.ServiceError, 'metadata'>> | null | undefined): string {
  const values = err && err.metadata ? err.metadata.get(ERROR_FIELD_METADATA) : [];
  return values.length ? String(values[0]) : '';
}
